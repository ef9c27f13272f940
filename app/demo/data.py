"""Synthetic chat data for the bundled demo model (fixed seeds, no downloads).

Every sample is a list of chat messages plus the text the assistant must produce for the
last turn (`target`), rendered later through the model's own chat template so training
sees exactly what the server will send. Tasks:
- arithmetic ("Solve 47 * 36."): a worked scratchpad inside <think>...</think> when thinking
  is on, the bare answer when it is off (the template then pre-fills an empty think block);
- tool use: tools in the system prompt, a request that needs one -> a Qwen-style
  <tool_call> with arguments copied from the request; after the tool result, an answer
  from it; no call when the request needs none;
- short plain replies (greetings, "what can you do").

Held-out evaluation problems are split off by hashing, so the training stream never sees
them (`is_heldout`).
"""
from __future__ import annotations

import json
import random
import zlib

THINK_EMPTY = "<think>\n\n</think>\n\n"

# --------------------------------------------------------------------------- held-out split

def is_heldout(key: str, percent: int = 10) -> bool:
    """A stable ~percent% of keys (problems, argument values) belong to evaluation only."""
    return zlib.crc32(key.encode()) % 100 < percent


def _fresh(rng: random.Random, draw, heldout: bool, tries: int = 100):
    """Draw until the item's key is on the requested side of the split."""
    for _ in range(tries):
        item = draw(rng)
        if is_heldout(item[0]) == heldout:
            return item
    return item


# --------------------------------------------------------------------------- arithmetic

ASK = ["Solve {q}.", "Solve {q}.", "Solve {q}.", "What is {q}?", "Compute {q}.",
       "Calculate {q}.", "{q} = ?", "What's {q}?", "Please solve {q}.", "How much is {q}?"]


def add_problem(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a} + {b}", a, b, "+"


def mul21_problem(rng):
    a, b = rng.randint(10, 99), rng.randint(2, 9)
    if rng.random() < 0.5:
        return f"{a} * {b}", a, b, "*"
    return f"{b} * {a}", b, a, "*"


def mul22_problem(rng):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a} * {b}", a, b, "*"


def _leaks(a: int, b: int) -> bool:
    """A 2x2 scratchpad writes the 2x1 products a * (b % 10) and a * (b // 10): keep
    held-out 2x1 problems out of training scratchpads too."""
    return any(is_heldout(f"{a} * {d}") for d in (b % 10, b // 10) if d >= 2)


def add_steps(a: int, b: int) -> list[str]:
    """Units first, then tens (then hundreds for a 3-digit a): the carry is written out
    before it is needed."""
    units, tens = a % 10 + b % 10, (a // 10 % 10 + b // 10 % 10) * 10
    steps = [f"{a % 10} + {b % 10} = {units}",
             f"{a // 10 % 10 * 10} + {b // 10 % 10 * 10} = {tens}"]
    if a >= 100:
        steps.append(f"{a // 100 * 100} + {tens} = {a // 100 * 100 + tens}")
        tens += a // 100 * 100
    return steps + [f"{tens} + {units} = {tens + units}"]


def mul21_steps(a: int, b: int) -> list[str]:
    """a * b with one 2-digit factor: split the 2-digit one into tens and units."""
    big, d = (a, b) if a >= 10 else (b, a)
    t, u = big // 10 * 10, big % 10
    return [f"{big} * {d} = {t} * {d} + {u} * {d}", f"{t} * {d} = {t * d}",
            f"{u} * {d} = {u * d}", f"{t * d} + {u * d} = {big * d}"]


def mul22_steps(a: int, b: int) -> list[str]:
    """47 * 36 = 47 * 30 + 47 * 6. Both partial products are 2x1 facts; their sum
    1410 + 282 is (141 + 28) tens plus the units digit 2, and 141 + 28 is done place by
    place like the addition scratchpad, so every line is one small step."""
    t, u = b // 10, b % 10
    lo, hi = a * u, a * t
    tens = lo // 10  # 282 -> 28 tens and 2 units
    steps = [f"{a} * {b} = {a} * {t * 10} + {a} * {u}",
             f"{a} * {u} = {lo}",
             f"{a} * {t} = {hi}",
             f"{hi * 10} + {lo} = {hi} tens + {tens} tens + {lo % 10}"]
    steps += add_steps(hi, tens)
    steps.append(f"{hi + tens} tens + {lo % 10} = {a * b}")
    return steps


def arithmetic_answer(q: str, value: int) -> str:
    return f"{q} = {value}"


def arithmetic_sample(rng, kind: str, thinking: bool, heldout: bool = False) -> dict:
    draw = {"add": add_problem, "mul21": mul21_problem, "mul22": mul22_problem}[kind]
    q, a, b, op = _fresh(rng, draw, heldout)
    while kind == "mul22" and not heldout and _leaks(a, b):
        q, a, b, op = _fresh(rng, draw, heldout)
    value = a + b if op == "+" else a * b
    steps = (add_steps(a, b) if op == "+" else
             mul21_steps(a, b) if kind == "mul21" else mul22_steps(a, b))
    user = rng.choice(ASK).format(q=q)
    answer = arithmetic_answer(q, value)
    target = ("<think>\n" + "\n".join(steps) + "\n</think>\n\n" + answer) if thinking else answer
    return dict(messages=_with_system(rng, [{"role": "user", "content": user}]),
                tools=None, thinking=thinking, target=target, kind=kind, expect=value)


# --------------------------------------------------------------------------- tools

CITIES = ("Paris London Tokyo Berlin Madrid Rome Lisbon Oslo Vienna Prague Dublin Cairo Lima "
          "Quito Delhi Seoul Sydney Toronto Boston Denver Austin Chicago Miami Seattle Zurich "
          "Geneva Milan Naples Porto Bergen Helsinki Warsaw Krakow Athens Istanbul Dubai Doha "
          "Nairobi Lagos Accra Dakar Tunis Mumbai Chennai Hanoi Manila Jakarta Bangkok Osaka "
          "Kyoto Busan Perth Auckland Vancouver Montreal Havana Bogota Santiago Caracas").split()
COUNTRIES = ("France Japan Brazil Canada Kenya Norway Peru Egypt India Chile Spain Italy "
             "Mexico Ghana Poland Greece Turkey Vietnam Nepal Iceland Ireland Portugal "
             "Sweden Finland Austria Morocco Senegal Colombia Argentina Thailand").split()
WORDS = ("serendipity ephemeral laconic ubiquitous quixotic mellifluous sonder petrichor "
         "halcyon lucid verbose candid frugal nimble placid arcane brisk cogent dapper "
         "eloquent fervent gallant hapless jovial keen lavish morose nascent opulent pensive "
         "robust serene tacit vivid wistful zealous").split()
SYMBOLS = "AAPL MSFT GOOG AMZN TSLA NVDA META IBM ORCL INTC AMD NFLX UBER SHOP SAP ADBE".split()
TOPICS = ("solar power", "electric cars", "the olympics", "space travel", "coral reefs",
          "quantum computing", "jazz history", "climate change", "chess openings",
          "ancient rome", "deep sea fish", "volcanoes", "honey bees", "tea culture",
          "mountain biking", "renewable energy", "black holes", "city gardens")
PEOPLE = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan",
          "judy", "mallory", "oscar", "peggy", "trent", "victor", "walter")
DOMAINS_MAIL = ("example.com", "mail.org", "work.net", "corp.io")
LANGS = ("French", "Spanish", "German", "Italian", "Japanese", "Korean", "Dutch", "Greek")
PHRASES = ("good morning", "thank you very much", "where is the station", "I love books",
           "see you tomorrow", "the cat is asleep", "how are you", "happy birthday")
CURRENCIES = ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR", "BRL", "SEK")
SONGS = ("Blue Moon", "Yellow", "Imagine", "Hurt", "Wonderwall", "Creep", "Halo", "Hello",
         "Skyfall", "Believer", "Roar", "Fix You")
CUISINES = ("thai", "italian", "mexican", "indian", "sushi", "vegan", "greek", "korean")


def _time(rng) -> str:
    return f"{rng.randint(5, 11)}:{rng.choice(['00', '15', '30', '45'])}"


def _email(rng) -> str:
    return f"{rng.choice(PEOPLE)}@{rng.choice(DOMAINS_MAIL)}"


# Each domain: name stems and verbs (names are built from them, so unseen combinations
# still look familiar), parameter specs (key choices, value drawer), request phrasings
# (arguments appear verbatim so the model learns to copy), a fake result and an answer.
DOMAINS = {
    "weather": dict(
        verbs=["get", "fetch", "lookup", "check", "current"], stems=["weather", "forecast", "weather_report"],
        desc=["Get the current weather for a city", "Look up today's weather in a location",
              "Current weather conditions"],
        params=[(["city", "location", "city_name"], "string", lambda r: r.choice(CITIES))],
        asks=["What's the weather in {0}?", "What is the weather like in {0} today?",
              "Is it raining in {0}?", "How warm is it in {0} right now?",
              "Tell me the weather in {0}.", "Weather in {0} please.", "Do I need an umbrella in {0}?"],
        result=lambda r, a: {"temperature": r.randint(-5, 35), "condition": r.choice(
            ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"])},
        answer=lambda a, res: f"It is {res['condition']} in {a[0]} with a temperature of {res['temperature']} degrees."),
    "stock": dict(
        verbs=["get", "fetch", "lookup", "query"], stems=["stock_price", "share_price", "quote"],
        desc=["Get the latest stock price for a ticker symbol", "Current share price of a company"],
        params=[(["symbol", "ticker"], "string", lambda r: r.choice(SYMBOLS))],
        asks=["What is the stock price of {0}?", "How much is {0} trading at?",
              "Get me the latest quote for {0}.", "What's {0} stock at right now?"],
        result=lambda r, a: {"price": round(r.uniform(10, 900), 2), "currency": "USD"},
        answer=lambda a, res: f"{a[0]} is trading at {res['price']} USD."),
    "time": dict(
        verbs=["get", "lookup", "check", "current"], stems=["time", "local_time", "clock"],
        desc=["Get the current local time in a city", "Local time for a location"],
        params=[(["city", "location"], "string", lambda r: r.choice(CITIES))],
        asks=["What time is it in {0}?", "What's the local time in {0}?",
              "Tell me the current time in {0}.", "Is it late in {0} now?"],
        result=lambda r, a: {"time": f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}"},
        answer=lambda a, res: f"The local time in {a[0]} is {res['time']}."),
    "email": dict(
        verbs=["send", "compose", "write"], stems=["email", "mail", "message"],
        desc=["Send an email to a recipient", "Send a short email message"],
        params=[(["to", "recipient"], "string", _email),
                (["subject", "title"], "string", lambda r: r.choice(TOPICS))],
        asks=["Send an email to {0} about {1}.", "Email {0} with the subject {1}.",
              "Please write to {0} about {1}.", "Mail {0} regarding {1}."],
        result=lambda r, a: {"status": "sent"},
        answer=lambda a, res: f"Done, the email to {a[0]} about {a[1]} was sent."),
    "translate": dict(
        verbs=["translate", "do", "run"], stems=["text", "translation", "phrase"],
        desc=["Translate text into another language", "Translate a phrase"],
        params=[(["text", "phrase"], "string", lambda r: r.choice(PHRASES)),
                (["target_language", "language", "to"], "string", lambda r: r.choice(LANGS))],
        asks=["Translate \"{0}\" into {1}.", "How do you say \"{0}\" in {1}?",
              "Please translate \"{0}\" to {1}."],
        result=lambda r, a: {"translation": f"[{a[1]}] {a[0]}"},
        answer=lambda a, res: f"In {a[1]}, \"{a[0]}\" is: {res['translation']}"),
    "search": dict(
        verbs=["search", "web", "find"], stems=["web", "search", "articles", "pages"],
        desc=["Search the web for a query", "Find web pages about a topic"],
        params=[(["query", "q", "terms"], "string", lambda r: r.choice(TOPICS))],
        asks=["Search the web for {0}.", "Look up {0} online.", "Find me articles about {0}.",
              "Can you search for {0}?"],
        result=lambda r, a: {"top_result": f"A short guide to {a[0]}"},
        answer=lambda a, res: f"The top result for {a[0]} is \"{res['top_result']}\"."),
    "currency": dict(
        verbs=["convert", "exchange"], stems=["currency", "money", "amount"],
        desc=["Convert an amount between currencies", "Currency conversion"],
        params=[(["amount", "value"], "number", lambda r: r.randint(1, 999)),
                (["from_currency", "source", "from"], "string", lambda r: r.choice(CURRENCIES)),
                (["to_currency", "target", "to"], "string", lambda r: r.choice(CURRENCIES))],
        asks=["Convert {0} {1} to {2}.", "How much is {0} {1} in {2}?",
              "What is {0} {1} in {2}?", "Change {0} {1} into {2}."],
        result=lambda r, a: {"converted": round(a[0] * r.uniform(0.5, 1.5), 2)},
        answer=lambda a, res: f"{a[0]} {a[1]} is about {res['converted']} {a[2]}."),
    "alarm": dict(
        verbs=["set", "create", "add"], stems=["alarm", "wakeup", "timer"],
        desc=["Set an alarm for a given time", "Create an alarm"],
        params=[(["time", "at"], "string", _time)],
        asks=["Set an alarm for {0}.", "Wake me up at {0}.", "Please set an alarm at {0}."],
        result=lambda r, a: {"status": "ok"},
        answer=lambda a, res: f"Your alarm is set for {a[0]}."),
    "population": dict(
        verbs=["get", "lookup", "fetch"], stems=["population", "country_population"],
        desc=["Get the population of a country", "Population lookup"],
        params=[(["country", "nation"], "string", lambda r: r.choice(COUNTRIES))],
        asks=["What is the population of {0}?", "How many people live in {0}?",
              "Population of {0}?"],
        result=lambda r, a: {"population": r.randint(1, 300) * 1000000},
        answer=lambda a, res: f"{a[0]} has a population of about {res['population']}."),
    "define": dict(
        verbs=["define", "lookup", "get"], stems=["word", "definition", "meaning"],
        desc=["Look up the definition of an English word", "Dictionary definition"],
        params=[(["word", "term"], "string", lambda r: r.choice(WORDS))],
        asks=["What does {0} mean?", "Define {0}.", "Give me the meaning of the word {0}."],
        result=lambda r, a: {"definition": f"the meaning of {a[0]}"},
        answer=lambda a, res: f"{a[0].capitalize()} means: {res['definition']}."),
    "music": dict(
        verbs=["play", "start", "queue"], stems=["song", "music", "track"],
        desc=["Play a song by title", "Start playing a track"],
        params=[(["title", "song"], "string", lambda r: r.choice(SONGS))],
        asks=["Play {0}.", "Put on the song {0}.", "Can you play {0} for me?"],
        result=lambda r, a: {"status": "playing"},
        answer=lambda a, res: f"Now playing {a[0]}."),
    "restaurant": dict(
        verbs=["find", "search", "lookup"], stems=["restaurants", "places_to_eat", "food"],
        desc=["Find restaurants in a city by cuisine", "Restaurant search"],
        params=[(["city", "location"], "string", lambda r: r.choice(CITIES)),
                (["cuisine", "food_type"], "string", lambda r: r.choice(CUISINES))],
        asks=["Find {1} restaurants in {0}.", "Where can I eat {1} food in {0}?",
              "Any good {1} places in {0}?"],
        result=lambda r, a: {"name": f"The {a[1].capitalize()} House", "rating": r.randint(3, 5)},
        answer=lambda a, res: f"Try {res['name']} in {a[0]}, rated {res['rating']} out of 5."),
}
# A few domains appear only in evaluation: do tool names/descriptions generalise?
EVAL_ONLY_NAMES = {"weather": "weather_now", "stock": "ticker_price", "time": "world_clock",
                   "email": "dispatch_email", "search": "web_lookup", "currency": "fx_convert"}

NO_TOOL_ASKS = ["Hello!", "Hi there.", "Thanks!", "What can you do?", "Who are you?",
                "Tell me a fun fact.", "Good morning!", "How are you?"]


# Most training tools get a name that says nothing about their domain: random pieces
# (made-up syllables, unrelated words, other domains' words) joined with "_", so copying
# the name from the schema is the only way to get it right, and names seen only in
# evaluation (`weather_now`) are copied the same way. A quarter keep a domain-looking name.
NAME_WORDS = ("alpha beta gamma delta omega nova apex zen echo orbit pixel quartz ruby "
              "cobalt maple cedar delphi atlas vega lyra tango kilo sierra juno now live "
              "quick smart daily fast main my api tool fn service v2 pro info data").split()
SYLLABLES = ("ka ri to mu ne sa lo vi de ba zu po fe gi ha ju ko la me ni ro su ta wa "
             "ye zo bri cha dro fla gra kle pla qua sti tre vor").split()


def made_up_word(rng, capital: bool = False) -> str:
    word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
    return word.capitalize() if capital else word


def tool_name(rng, domain: str) -> str:
    r = rng.random()
    if r < 0.25:
        d = DOMAINS[domain]
        return f"{rng.choice(d['verbs'])}_{rng.choice(d['stems'])}"
    pieces = []
    for _ in range(rng.randint(1, 3)):
        x = rng.random()
        if x < 0.4:
            pieces.append(made_up_word(rng))
        elif x < 0.7:
            pieces.append(rng.choice(NAME_WORDS))
        else:  # a word from a random domain: a name's words must not predict its domain
            other = DOMAINS[rng.choice(list(DOMAINS))]
            pieces.append(rng.choice(other["verbs"] + other["stems"]))
    return "_".join(pieces) if len(pieces) > 1 else f"{pieces[0]}_{rng.choice(NAME_WORDS)}"


def tool_schema(rng, domain: str, name: str) -> tuple[dict, list[str]]:
    """An OpenAI-style tool definition; returns it and the chosen argument keys in order."""
    d = DOMAINS[domain]
    keys, props = [], {}
    for choices, typ, _ in d["params"]:
        key = rng.choice(choices)
        keys.append(key)
        props[key] = {"type": typ}
    fn = {"name": name, "description": rng.choice(d["desc"]),
          "parameters": {"type": "object", "properties": props, "required": list(keys)}}
    return {"type": "function", "function": fn}, keys


def _args(rng, domain: str, made_up: bool = False) -> list:
    """Argument values; with `made_up`, string values are invented words so they can only
    be copied from the request (plain values may then be written from memory)."""
    vals = []
    for choices, typ, draw in DOMAINS[domain]["params"]:
        v = draw(rng)
        if made_up and typ == "string" and "@" not in str(v) and ":" not in str(v):
            v = made_up_word(rng, capital=str(v)[:1].isupper())
        while isinstance(v, str) and len(DOMAINS[domain]["params"]) > 1 and v in vals:
            v = draw(rng)
        vals.append(v)
    return vals


def _toolset(rng, need: str | None, heldout: bool, exclude: str | None = None,
             pair: float | None = None) -> tuple[list[dict], dict]:
    """1-2 tools; `need` (if given) among them at a random position, with another tool half
    the time (or at rate `pair`); `exclude` never. Returns the tools and {domain: (name, keys)}."""
    others = [d for d in DOMAINS if d not in (need, exclude)]
    # At most two tools: each schema costs ~50 prompt tokens and training time is scarce.
    if need:
        # randint for the default keeps the base mixture and eval set the samples they were
        count = rng.randint(0, 1) if pair is None else int(rng.random() < pair)
    else:
        count = rng.randint(1, 2)
    picked = rng.sample(others, count) + ([need] if need else [])
    rng.shuffle(picked)
    tools, info = [], {}
    for dom in picked:
        name = EVAL_ONLY_NAMES[dom] if heldout and dom == need and dom in EVAL_ONLY_NAMES \
            and rng.random() < 0.5 else tool_name(rng, dom)
        while not heldout and name in EVAL_ONLY_NAMES.values():
            name = tool_name(rng, dom)
        schema, keys = tool_schema(rng, dom, name)
        tools.append(schema)
        info[dom] = (name, keys)
    return tools, info


def call_text(name: str, arguments: dict) -> str:
    """Exactly what the chat template renders for an assistant tool call."""
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + '}\n</tool_call>'


def copied_after_space(values, request: str) -> list[str]:
    """The string values that the request has after a space, in order: byte-level BPE makes
    that space part of their first token (` T`, `h`, `ail`, `an`, `d` for `Thailand`), which
    a quoted value lacks (`Th`, `ail`, `an`, `d`); train.py can spell them the request's way."""
    return [v for v in values if isinstance(v, str) and f" {v}" in request]


def tool_call_sample(rng, thinking: bool, heldout: bool = False, pair: float | None = None,
                     made_up: float = 0.3) -> dict:
    def draw(r):
        dom = r.choice(list(DOMAINS))
        vals = _args(r, dom, made_up=not heldout and r.random() < made_up)
        return f"{dom}:{vals}", dom, vals
    _, dom, vals = _fresh(rng, draw, heldout, tries=200)
    tools, info = _toolset(rng, dom, heldout, pair=pair)
    name, keys = info[dom]
    arguments = dict(zip(keys, vals))
    user = rng.choice(DOMAINS[dom]["asks"]).format(*vals)
    target = (THINK_EMPTY if thinking else "") + call_text(name, arguments)
    return dict(messages=_with_system(rng, [{"role": "user", "content": user}]), tools=tools,
                thinking=thinking, target=target, kind="tool_call",
                expect={"name": name, "arguments": arguments},
                copied=copied_after_space(vals, user))


def tool_result_sample(rng, thinking: bool) -> dict:
    """The turn after a tool result: answer from it, no new call."""
    dom = rng.choice(list(DOMAINS))
    vals = _args(rng, dom)
    tools, info = _toolset(rng, dom, False)
    name, keys = info[dom]
    arguments = dict(zip(keys, vals))
    result = DOMAINS[dom]["result"](rng, vals)
    messages = _with_system(rng, [
        {"role": "user", "content": rng.choice(DOMAINS[dom]["asks"]).format(*vals)},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "content": json.dumps(result)}])
    answer = DOMAINS[dom]["answer"](vals, result)
    target = (THINK_EMPTY if thinking else "") + answer
    return dict(messages=messages, tools=tools, thinking=thinking, target=target,
                kind="tool_result", expect=answer)


DECLINE = "Sorry, none of my tools can do that, so I cannot help with this request."


def decline_sample(rng, thinking: bool, heldout: bool = False) -> dict:
    """A tool request that none of the offered tools covers: the same prompts as
    tool_call_sample with the needed tool left out, so only the schemas tell them apart."""
    dom = rng.choice(list(DOMAINS))
    tools, _ = _toolset(rng, None, heldout, exclude=dom)
    user = rng.choice(DOMAINS[dom]["asks"]).format(*_args(rng, dom, made_up=not heldout and rng.random() < 0.3))
    return dict(messages=_with_system(rng, [{"role": "user", "content": user}]), tools=tools,
                thinking=thinking, target=(THINK_EMPTY if thinking else "") + DECLINE,
                kind="no_tool", expect=None)


def no_tool_sample(rng, thinking: bool, heldout: bool = False) -> dict:
    """Tools are offered but the request needs none of them: answer directly."""
    r = rng.random()
    if r >= 0.75:
        return decline_sample(rng, thinking, heldout)
    tools, _ = _toolset(rng, None, heldout)
    if r < 0.4:  # arithmetic with tools around: still solved by hand
        kind = rng.choice(["add", "mul21"])
        s = arithmetic_sample(rng, kind, thinking, heldout)
        s.update(tools=tools, kind="no_tool", expect=None,
                 messages=_with_system(rng, [m for m in s["messages"] if m["role"] == "user"]))
        return s
    user = rng.choice(NO_TOOL_ASKS)
    target = (THINK_EMPTY if thinking else "") + plain_reply(user)
    return dict(messages=_with_system(rng, [{"role": "user", "content": user}]), tools=tools,
                thinking=thinking, target=target, kind="no_tool", expect=None)


# --------------------------------------------------------------------------- plain chat

PLAIN = {
    "Hello!": "Hello! How can I help you today?",
    "Hi there.": "Hi! What can I do for you?",
    "Hi": "Hi! What can I do for you?",
    "Hey": "Hey! How can I help?",
    "Good morning!": "Good morning! How can I help you today?",
    "Thanks!": "You're welcome!",
    "Thank you.": "You're welcome!",
    "How are you?": "I'm doing well, thank you. How can I help?",
    "Who are you?": "I am the shoal demo model, a tiny assistant trained on this machine.",
    "What can you do?": "I can solve small arithmetic problems like 47 * 36, call the tools "
                        "you give me, and answer short greetings.",
    "What can you help me with?": "I can solve small arithmetic problems like 47 * 36, call "
                                  "the tools you give me, and answer short greetings.",
    "Tell me a fun fact.": "Fish in a shoal turn together by watching their neighbours.",
    "Goodbye!": "Goodbye! Have a nice day.",
    "Bye": "Goodbye! Have a nice day.",
}
SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant.",
           "You are shoal, a small helpful model.", "Answer briefly."]


def plain_reply(user: str) -> str:
    return PLAIN[user]


def plain_sample(rng, thinking: bool) -> dict:
    user = rng.choice(list(PLAIN))
    target = (THINK_EMPTY if thinking else "") + plain_reply(user)
    return dict(messages=_with_system(rng, [{"role": "user", "content": user}]), tools=None,
                thinking=thinking, target=target, kind="plain", expect=PLAIN[user])


COPY_ASKS = ["Repeat this line:\n{}", "Repeat after me:\n{}", "Copy this exactly:\n{}",
             "Say this back:\n{}", "Echo this:\n{}"]


def copy_sample(rng, thinking: bool) -> dict:
    """Repeat a line of made-up names and words. Every reply token can only be copied, which
    is what a tool call needs for an unseen name (train.py's tuning stages)."""
    words = []
    for _ in range(rng.randint(2, 5)):
        word = tool_name(rng, rng.choice(list(DOMAINS))) if rng.random() < 0.7 \
            else made_up_word(rng, capital=rng.random() < 0.5)
        while word in EVAL_ONLY_NAMES.values():
            word = tool_name(rng, rng.choice(list(DOMAINS)))
        words.append(word)
    line = " ".join(words)
    return dict(messages=[{"role": "user", "content": rng.choice(COPY_ASKS).format(line)}],
                tools=[], thinking=thinking, target=(THINK_EMPTY if thinking else "") + line,
                kind="copy", expect=line)


QUOTE_ASKS = ["Quote these words as a JSON list: {}", "Put these in a JSON list: {}",
              "Write these as JSON strings: {}", "Make a JSON list of: {}"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def random_word(rng) -> str:
    """Letters at random, lower, Capitalized or UPPER: BPE splits them every which way, so
    copying them cannot lean on pieces the model knows."""
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 8)))
    case = rng.random()
    return word.upper() if case < 0.2 else word.capitalize() if case < 0.6 else word


# The data's own letters-only words (values, names, topics): slices of them make words whose
# BPE pieces are those of real values (`ish` in `lavish`, `ic` in `Mexico`), which random
# letters seldom spell and the tuned models still miscopied.
VALUE_WORDS = sorted({w.lower() for w in " ".join(
    [*CITIES, *COUNTRIES, *WORDS, *LANGS, *NAME_WORDS, *PEOPLE, *TOPICS, *SONGS]
).split() if w.isalpha()})


def spliced_word(rng) -> str:
    """Two or three slices of 2-4 letters of VALUE_WORDS (`lav` + `ico`), never one of them."""
    def piece():
        w = rng.choice(VALUE_WORDS)
        n = rng.randint(2, 4)
        i = rng.randint(0, max(0, len(w) - n))
        return w[i:i + n]
    word = "".join(piece() for _ in range(rng.randint(2, 3)))
    while word in VALUE_WORDS:
        word += piece()
    return word.capitalize() if rng.random() < 0.4 else word


def quote_word(rng) -> str:
    r = rng.random()
    return random_word(rng) if r < 0.4 else \
        made_up_word(rng, rng.random() < 0.5) if r < 0.7 else spliced_word(rng)


def quote_sample(rng, thinking: bool) -> dict:
    """Words from a sentence into JSON strings, what a tool call's arguments need: in the
    request a word comes after a space, which byte-level BPE makes part of its first token
    (` T`, `h`, `ail`, `an`, `d`), and in the call after a quote (`Th`, `ail`, `an`, `d`), so
    the copy must match a word across two spellings (docs/demo-model.md)."""
    words = [quote_word(rng) for _ in range(rng.randint(1, 4))]
    user = rng.choice(QUOTE_ASKS).format(" ".join(words))
    return dict(messages=[{"role": "user", "content": user}],
                tools=[], thinking=thinking, target=(THINK_EMPTY if thinking else "") + json.dumps(words),
                kind="quote", expect=json.dumps(words), copied=copied_after_space(words, user))


def _with_system(rng, messages: list[dict]) -> list[dict]:
    if rng.random() < 0.3:
        return [{"role": "system", "content": rng.choice(SYSTEMS)}] + messages
    return messages


# --------------------------------------------------------------------------- mixture

MIXTURE = [  # (weight, maker, share of samples with thinking on)
    # Bare answers (a carry done in one step) are the hard part of small arithmetic and the
    # cheapest samples (~35 tokens): most additions and 2x1 products are bare.
    (0.14, lambda r, t: arithmetic_sample(r, "add", t), 0.3),
    (0.20, lambda r, t: arithmetic_sample(r, "mul21", t), 0.3),
    # Bare 2x2 answers are out of reach for this model: 2x2 is always worked out.
    (0.20, lambda r, t: arithmetic_sample(r, "mul22", t), 1.0),
    (0.22, tool_call_sample, 0.5),
    (0.10, decline_sample, 0.5),
    (0.05, tool_result_sample, 0.5),
    (0.05, no_tool_sample, 0.5),
    (0.04, plain_sample, 0.5),
]


# The tuning stages (train.py): MIXTURE with copying and quoting at half the samples, then at
# a fifth (each task half of that).
def with_copying(share: float) -> list:
    """Tool calls there offer the needed tool with another one 80% of the time (the base
    mixture: half): which name to copy is what the tuned model still gets wrong. 60% of
    their string values are invented words (base mixture: 30%), which only copying gets right."""
    def paired_call(rng, thinking):
        return tool_call_sample(rng, thinking, pair=0.8, made_up=0.6)
    base = [(w, paired_call if make is tool_call_sample else make, t) for w, make, t in MIXTURE]
    return [(w * (1 - share), make, t) for w, make, t in base[:-1]] + \
        [(share / 2, copy_sample, 0.3), (share / 2, quote_sample, 0.3),
         (base[-1][0] * (1 - share),) + base[-1][1:]]


COPY_MIXTURE = with_copying(0.5)
TUNE_MIXTURE = with_copying(0.2)


def sample(rng: random.Random, mixture: list = MIXTURE) -> dict:
    """One training sample, drawn by mixture weight (the last entry takes the remainder)."""
    x = rng.random()
    for weight, make, thinking in mixture[:-1]:
        if x < weight:
            return make(rng, rng.random() < thinking)
        x -= weight
    _, make, thinking = mixture[-1]
    return make(rng, rng.random() < thinking)


def stream(seed: int, mixture: list = MIXTURE):
    rng = random.Random(seed)
    while True:
        yield sample(rng, mixture)


def eval_set(n: int = 100, seed: int = 20261122) -> dict[str, list[dict]]:
    """Held-out problems per eval row (none of them ever appears in training)."""
    rng = random.Random(seed)
    return {
        "add": [arithmetic_sample(rng, "add", False, heldout=True) for _ in range(n)],
        "add_think": [arithmetic_sample(rng, "add", True, heldout=True) for _ in range(n)],
        "mul21": [arithmetic_sample(rng, "mul21", False, heldout=True) for _ in range(n)],
        "mul21_think": [arithmetic_sample(rng, "mul21", True, heldout=True) for _ in range(n)],
        "mul22_think": [arithmetic_sample(rng, "mul22", True, heldout=True) for _ in range(n)],
        "tool_call": [tool_call_sample(rng, rng.random() < 0.5, heldout=True) for _ in range(n)],
        "no_tool": [no_tool_sample(rng, rng.random() < 0.5, heldout=True) for _ in range(n)],
    }


def corpus(n: int = 3000, seed: int = 99) -> list[str]:
    """Text for training the BPE: whole chats as the chat template renders them (the tools
    preamble, role headers and schemas included, so they become a few tokens each instead
    of ~130 byte-sized ones), each followed by its target."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from app.protocol.chatml import CHAT_TEMPLATE
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = sample(rng)
        (prompt,), _ = render_jinja_template([s["messages"]], tools=s["tools"],
                                             chat_template=CHAT_TEMPLATE,
                                             add_generation_prompt=True,
                                             enable_thinking=s["thinking"])
        out.append(prompt + s["target"])
    return out
