"""Synthetic chat data for the trained embedded model (`tiny-chat`), rendered through our own
chat template and tokenized with the real Qwen tokenizer.

Every sample is (prompt ids, completion ids): the prompt is what the server would render for the
conversation (the generation prompt included, thinking on or off), the completion is what the
model should write, ending with <|im_end|>. Tasks:

- greet:     "Say hello." and its kin -> a short greeting
- echo:      "Repeat the word W." -> W
- add:       "What is a + b?" -> the sum (0..99)
- lang:      "What language is this? <snippet>" -> the language's name
- read:      with OMP's read/bash tools offered, "Read the file P" -> a read call with path P
- bash:      "Run the command: C" -> a bash call with command C
- followup:  after a read call and its tool_response, a one-line answer quoting the file
- retrieve:  a fact (one of many forms, FACT_FORMS x NOUNS) planted late in filler text (words or
             a log of varied line forms); the question for the fact's key -> its value

Words that no list holds (`made_up`, syllables) fill 30% of path stems and half of the planted
values, so that a path or a value must be copied from the prompt, not recalled. Held out from
training: the path src/unseen_name.py (the tests ask for it), and the qualification's retrieval
prompt (lanes/qualify_phases.py): its key "vault", its fact's form ("Note: the K N is V. Keep
it.") and its log line's form are in no training row. Everything is drawn
from a numpy Generator the caller seeds, so the data is a pure function of the seed; the
evaluation (engine/train/evaluate.py) draws with a seed training never used.
"""
from __future__ import annotations

from engine.text.chat import default_chat_template, render_chat

WORDS = """apple river stone cloud green paper house light music water table window garden
orange silver planet yellow forest candle bridge dragon pencil rocket basket butter coffee
market summer winter spring autumn morning evening island mountain valley ocean desert
castle engine button letter number circle square banana cherry lemon tomato potato carrot
tiger zebra monkey rabbit turtle eagle falcon salmon spider camel horse mouse sheep goat
purple violet golden bronze copper marble velvet cotton wooden plastic simple quiet happy
bright little gentle secret hidden ancient modern frozen broken open closed final first
second third north south east west red blue black white brown pink gray ruby jade amber
name unseen data model file main test util config parser server client reader writer
buffer cache index store queue stack graph token vector matrix kernel driver loader
socket stream thread worker handler router schema record report notes draft sketch
alpha beta gamma delta omega kilo lima mike oscar papa romeo sierra tango victor""".split()

DIRS = ["src", "lib", "tests", "docs", "app", "core", "pkg", "tools", "scripts", "engine",
        "server", "web", "api", "bin", "etc", "build", "data", "config", "utils", "internal"]
EXTS = [".py", ".md", ".txt", ".json", ".toml", ".rs", ".go", ".js", ".ts", ".c", ".h",
        ".yaml", ".sh", ".cfg", ".csv", ""]
HELD_OUT_PATH = "src/unseen_name.py"

GREET_PROMPTS = ["Say hello.", "Hello!", "Hi", "hi", "Hello", "Hey there.", "Good morning!",
                 "Say hi.", "Greet me.", "Hello, who are you?", "hey", "Good evening.",
                 "Please say hello.", "Hi there!", "Say hello to me."]
GREET_REPLIES = ["Hello! How can I help you today?", "Hi! What can I do for you?",
                 "Hello there! How can I help?"]

LANGS = {
    "Python": ["def {a}({b}):\n    return {b}", "import {a}\nprint({a}.{b})",
               "for {a} in range(10):\n    print({a})", "class {A}:\n    pass"],
    "JavaScript": ["function {a}({b}) {{ return {b}; }}", "const {a} = ({b}) => {b};",
                   "console.log({a});", "let {a} = require('{b}');"],
    "Rust": ["fn {a}({b}: i32) -> i32 {{ {b} }}", "let mut {a} = Vec::new();",
             "use std::{a};", "println!(\"{{}}\", {a});"],
    "Go": ["func {a}({b} int) int {{ return {b} }}", "package {a}",
           "fmt.Println({a})", "{a} := make([]int, 0)"],
    "SQL": ["SELECT {a} FROM {b};", "INSERT INTO {a} VALUES (1);",
            "CREATE TABLE {a} (id INT);", "DELETE FROM {a} WHERE {b} = 1;"],
    "Shell": ["echo ${a}", "ls -la | grep {a}", "export {A}=1", "cd {a} && make"],
}

READ_ASKS = ["Read the file {p}", "Read the file {p}.", "Read {p}", "Show me {p}.",
             "Open {p} and show it to me.", "What is in {p}?", "Please read {p}.",
             "Can you read the file {p}?", "Look at {p}.", "Read the readme at {p}."]
BASH_ASKS = ["Run the command: {c}", "Run `{c}`", "Execute {c}", "Please run: {c}",
             "Run this in the shell: {c}"]
# what a read request may go on to ask ("Read the file P and tell me ...")
READ_THEN = ["what it says", "what the first line is", "who wrote it", "what it is for",
             "when the job runs", "how many lines it has", "what is wrong with it",
             "which version it names", "where the server listens", "what the build needs"]
LIST_ASKS = ["List the files in {d}.", "What files are in {d}?", "Show the directory {d}."]

# OMP's read and bash tools (the fields its requests send for them), as the template takes them
READ_TOOL = {"type": "function", "function": {
    "name": "read", "description": "Read a file, directory, or URL.",
    "parameters": {"type": "object", "properties": {"path": {
        "type": "string", "description": "Local path, internal URI (e.g. memory://), or URL. "
        "Inline selectors are supported."}}, "required": ["path"]}}}
BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {
        "command": {"type": "string", "description": "command to execute"},
        "timeout": {"type": "number", "description": "timeout in seconds"},
        "cwd": {"type": "string", "description": "working directory"}},
        "required": ["command"]}}}
OTHER_TOOLS = ["edit", "glob", "grep", "task", "todo", "web_search", "eval", "write"]
SYSTEMS = ["", "", "You are a helpful assistant.", "You are a coding agent.",
           "Answer briefly.", "You are a helpful coding assistant working in a repository."]

TEMPLATE = default_chat_template()


# short words that join the parts of a file name ("notes_for_review")
LINKS = "for of to and with new old from by my our at on in all".split()
ONSETS = ("b c d f g h j k l m n p r s t v w z qu br cr dr fl gl pl sk st tr sh ch th "
          "sl sn gr pr").split()
VOWELS = "a e i o u a e i o u ai ea ou oo ie y".split()
CODAS = ["", "", "", "", "n", "r", "l", "s", "x", "ll", "ck", "m", "t", "nd", "rk", "st"]


def _word(rng) -> str:
    return WORDS[rng.integers(len(WORDS))]


def made_up(rng) -> str:
    """A lower-case word of 1 to 3 syllables that no list here holds ("quill", "drasteb")."""
    return "".join(ONSETS[rng.integers(len(ONSETS))] + VOWELS[rng.integers(len(VOWELS))]
                   + CODAS[rng.integers(len(CODAS))] for _ in range(rng.integers(1, 4)))


def _stem_word(rng, i: int) -> str:
    if rng.random() < 0.3:
        return made_up(rng)
    if i > 0 and rng.random() < 0.25:
        return LINKS[rng.integers(len(LINKS))]
    return _word(rng)


def random_path(rng) -> str:
    while True:
        parts = [DIRS[rng.integers(len(DIRS))] for _ in range(rng.integers(0, 3))]
        sep = ["_", "-", ""][rng.integers(3)]
        stem = sep.join(_stem_word(rng, i) for i in range(rng.integers(1, 4)))
        p = "/".join(parts + [stem + EXTS[rng.integers(len(EXTS))]])
        if p != HELD_OUT_PATH:
            return p


def random_command(rng) -> str:
    p = random_path(rng)
    forms = ["ls {d}", "cat {p}", "git status", "git log -n {n}", "wc -l {p}", "pytest {p}",
             "grep -rn {w} {d}", "python {p}", "make {w}", "echo {w}", "head -n {n} {p}"]
    f = forms[rng.integers(len(forms))]
    return f.format(d=DIRS[rng.integers(len(DIRS))], p=p, n=int(rng.integers(1, 50)),
                    w=_word(rng))


def _read_ask(rng, p: str) -> str:
    if rng.random() < 0.35:
        return f"Read the file {p} and tell me {READ_THEN[rng.integers(len(READ_THEN))]}."
    return READ_ASKS[rng.integers(len(READ_ASKS))].format(p=p)


def _prose(rng, n_words: int) -> str:
    """About n_words of sentences of random words: a long tool description or system text."""
    lines, _ = _filler_lines(rng, n_words, words_only=True)
    return " ".join(lines)


def _tools(rng, describe: int = 0) -> list[dict]:
    """OMP's read and bash tools and some of its others; with `describe`, every tool's
    description grows by about that many words (OMP's own tools render to ~13.6K tokens)."""
    tools = [READ_TOOL, BASH_TOOL]
    if describe:
        tools = [{"type": "function", "function": dict(
            t["function"], description=t["function"]["description"] + " "
            + _prose(rng, describe))} for t in tools]
    extra = [n for n in OTHER_TOOLS if rng.random() < (0.8 if describe else 0.3)]
    tools += [{"type": "function", "function": {
        "name": n, "description": f"The {n} tool." + (" " + _prose(rng, describe)
                                                      if describe else ""),
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}},
                       "required": ["input"]}}} for n in extra]
    order = rng.permutation(len(tools))
    return [tools[i] for i in order]


def _call(name: str, args: dict) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def greet(rng):
    return GREET_PROMPTS[rng.integers(len(GREET_PROMPTS))], GREET_REPLIES[0]


def echo(rng):
    w = _word(rng)
    forms = [("Repeat the word {w}.", "{w}"), ("Say the word {w}.", "{w}"),
             ("Echo: {w}", "{w}"), ("Repeat after me: {w}", "{w}")]
    q, a = forms[rng.integers(len(forms))]
    return q.format(w=w), a.format(w=w)


def add(rng):
    a, b = int(rng.integers(0, 50)), int(rng.integers(0, 50))
    forms = ["What is {a} + {b}?", "{a} + {b} =", "Add {a} and {b}.", "Compute {a} + {b}."]
    return forms[rng.integers(len(forms))].format(a=a, b=b), str(a + b)


def lang(rng):
    names = list(LANGS)
    name = names[rng.integers(len(names))]
    snippets = LANGS[name]
    a, b = _word(rng), _word(rng)
    code = snippets[rng.integers(len(snippets))].format(a=a, b=b, A=a.upper())
    forms = ["What language is this?\n{c}", "Which programming language is this: {c}",
             "Name the language of this snippet:\n{c}"]
    return forms[rng.integers(len(forms))].format(c=code), name


def copy(rng):
    """"Repeat after me:" a few words, a path or a command -> the same text: dense practice
    at copying from the prompt, which the read, bash and retrieval tasks need."""
    kind = rng.integers(3)
    if kind == 0:
        text = " ".join(_word(rng) for _ in range(rng.integers(3, 12)))
    elif kind == 1:
        text = random_path(rng)
    else:
        text = random_command(rng)
    return f"Repeat after me:\n{text}", text


CHAT_TASKS = {"greet": greet, "echo": echo, "add": add, "lang": lang, "copy": copy}


def _render(system, user_turns, tools, thinking: bool) -> str:
    msgs = ([{"role": "system", "content": system}] if system else []) + user_turns
    return render_chat(TEMPLATE, msgs, tools=tools, add_generation_prompt=True,
                       enable_thinking=thinking, preserve_thinking=True)


def _completion(answer: str, thinking: bool) -> str:
    return ("\n</think>\n\n" if thinking else "") + answer + "<|im_end|>"


# What an agent client may put before the user's words: today's date and the working
# directory, which a tool call's arguments must not be copied from (the first is OMP's form).
REMINDERS = ["<system-reminder>\nToday: {d}; current working directory: '{w}'. Do not repeat "
             "this information in your reply.\n</system-reminder>",
             "<system-reminder>\nDate: {d}. Working directory: {w}.\n</system-reminder>\n",
             "<env>\ndate={d}\ncwd={w}\n</env>\n", "[context: {d}, in {w}]\n",
             "<system-reminder>\nIt is {d}. You are in {w}; {n} files changed since the last "
             "turn.\n</system-reminder>"]


def reminder(rng, form: int | None = None) -> str:
    """One of REMINDERS (or REMINDERS[form]) with a random date, directory and count."""
    d = f"{rng.integers(2019, 2031)}-{rng.integers(1, 13):02d}-{rng.integers(1, 29):02d}"
    parts = ["tmp", f"tmp{made_up(rng)}{rng.integers(10, 99)}", _word(rng), "work"] \
        if rng.random() < 0.5 else ["home", _word(rng), DIRS[rng.integers(len(DIRS))]]
    w = "/" + "/".join(parts)
    form = rng.integers(len(REMINDERS)) if form is None else form
    return REMINDERS[form].format(d=d, w=w, n=rng.integers(2, 40))


def chat_sample(rng, task: str, describe: int = 0, remind: float = 0.0,
                client: dict | None = None):
    """(prompt text, completion text) of one sample of `task`; `describe` > 0 gives it a long
    tools section (see `_tools`); with probability `remind` the user's words come after a
    `reminder` (a date and a directory). `client` ({"system", "tools"}, a captured agent
    client's own system text and tools, see batches.load_client) replaces both: the request is
    rendered as that client sends it, after the client's reminder four times in five."""
    thinking = rng.random() < 0.2
    system = SYSTEMS[rng.integers(len(SYSTEMS))]
    tools = (_tools(rng, describe) if describe or task in ("read", "bash", "followup")
             or rng.random() < 0.3 else None)
    before = reminder(rng) if remind and rng.random() < remind else ""
    if client is not None:
        system, tools, thinking = client["system"], client["tools"], False
        before = reminder(rng, 0) if rng.random() < 0.8 else ""
    if task in CHAT_TASKS:
        q, a = CHAT_TASKS[task](rng)
        return _render(system, [{"role": "user", "content": before + q}], tools, thinking), \
            _completion(a, thinking)
    if task == "read":
        p = random_path(rng)
        q = before + _read_ask(rng, p)
        return _render(system, [{"role": "user", "content": q}], tools, thinking), \
            _completion(_call("read", {"path": p}), thinking)
    if task == "bash":
        if rng.random() < 0.3:
            d = DIRS[rng.integers(len(DIRS))]
            q, c = LIST_ASKS[rng.integers(len(LIST_ASKS))].format(d=d), f"ls {d}"
        else:
            c = random_command(rng)
            q = BASH_ASKS[rng.integers(len(BASH_ASKS))].format(c=c)
        return _render(system, [{"role": "user", "content": before + q}], tools, thinking), \
            _completion(_call("bash", {"command": c}), thinking)
    if task == "followup":
        p = random_path(rng)
        content = " ".join(_word(rng) for _ in range(rng.integers(2, 8)))
        q = before + _read_ask(rng, p)
        turns = [{"role": "user", "content": q},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"type": "function", "function": {"name": "read",
                                                       "arguments": {"path": p}}}]},
                 {"role": "tool", "content": content}]
        return _render(system, turns, tools, thinking), \
            _completion(f"{p} says: {content}", thinking)
    raise ValueError(task)


NOUNS = ["code", "key", "id", "token", "pin", "password", "number", "tag", "serial", "secret",
         "value", "label"]
FACT_FORMS = ["The {n} for {k} is {v}.", "Remember: the {k} {n} is {v}.",
              "Note that the {k} {n} is {v}.", "{K} {n}: {v}", "Note: the {n} of {k} is {v}.",
              "Important: {k} {n} = {v}. Do not lose it.", "The {k} {n} is {v}. Remember it.",
              "Keep this in mind: the {k} {n} is {v}.", "Record {k}: {n} {v}.",
              "FYI, {k} uses {n} {v}.", "Note: the {k} {n} was set to {v}."]
ASK_FORMS = ["What is the {n} for {k}?", "What is the {k} {n}?", "Which {n} does {k} have?",
             "Tell me the {k} {n}.", "What was the {k} {n}?", "Recall the {n} of {k}."]
ASK_ENDS = ["", " Reply with the {n} only.", " Give only the {n}.", " Answer with the {n} only.",
            " Just the {n}, please.", " Only the value."]
LOG_HEADS = ["[{i:05d}]", "Log {i}:", "{i}.", "Entry {i:04d}:", "#{i}", "{h:02d}:{m:02d}:{s:02d}",
             "INFO", "step {i}:", "Event {i:05d} -"]
LOG_BODIES = ["{w} {w} {a} done in {t} ms.", "the {w} at host {a} closed job {b} after {t} ms.",
              "{w} worker {a} handled request {b} ({t} ms).", "moved {a} {w} items to {w}.",
              "the {w} {w} returned {a} rows in {t} ms.", "started {w} with {a} threads.",
              "{w} cache hit rate {a}% after {b} lookups.", "user {w} opened {w}/{w} at {a}.",
              "the {w} for shard {a} wrote {b} bytes.", "{w} queue depth {a}, {b} waiting."]


def _value(rng) -> str:
    """A value to plant: four distinct digits, alone or joined by hyphens to a word and two
    more digits ("7294-QUILL-38"), or a word then the digits; the word made up half the time."""
    digits = "".join(str(d) for d in rng.permutation(10)[:4])
    kind = rng.integers(4)
    if kind == 0:
        return digits
    word = made_up(rng) if rng.random() < 0.5 else _word(rng)
    if kind in (1, 2):
        return f"{digits}-{word.upper()}-{int(rng.integers(10, 100))}"
    return f"{word}-{digits}"


def _log_line(rng, form: tuple[int, int], i: int) -> str:
    head, body = LOG_HEADS[form[0]], LOG_BODIES[form[1]]
    while "{w}" in body:
        body = body.replace("{w}", _word(rng), 1)
    h, m = divmod(i * 7 % 1440, 60)
    return head.format(i=i, h=h % 24, m=m, s=i * 13 % 60) + " " + body.format(
        a=int(rng.integers(1000)), b=int(rng.integers(10000)), t=int(rng.integers(1, 100)))


def _filler_lines(rng, n_words: int, words_only: bool = False) -> tuple[list[str], str]:
    """Filler and what joins its lines: sentences of random words, or a log whose lines share
    one of LOG_HEADS x LOG_BODIES' forms and count up from a random start."""
    if words_only or rng.random() < 0.4:
        words = [_word(rng) for _ in range(n_words)]
        out, i = [], 0
        while i < len(words):
            n = int(rng.integers(5, 12))
            out.append(" ".join(words[i:i + n]).capitalize() + ".")
            i += n
        return out, " "
    form = (int(rng.integers(len(LOG_HEADS))), int(rng.integers(len(LOG_BODIES))))
    first = int(rng.integers(0, 2)) * int(rng.integers(1000))
    out, used = [], 0
    while used < n_words:
        out.append(_log_line(rng, form, first + len(out)))
        used += 14  # a line is ~20 tokens, as many as ~14 filler words
    return out, "\n"


def retrieval_sample(rng, n_filler: int, depth: float | None = None):
    """A planted fact (one of FACT_FORMS, its value from `_value`) at a depth in [0.8, 0.97]
    of about n_filler words of filler (or at `depth`), with up to two distractor facts of the
    same form earlier; asks for the planted key's value."""
    key = made_up(rng) if rng.random() < 0.3 else _word(rng)
    noun = NOUNS[rng.integers(len(NOUNS))]
    fact = FACT_FORMS[rng.integers(len(FACT_FORMS))].replace("{n}", noun)
    ask = (ASK_FORMS[rng.integers(len(ASK_FORMS))] + ASK_ENDS[rng.integers(len(ASK_ENDS))]
           ).replace("{n}", noun)
    value = _value(rng)
    sentences, sep = _filler_lines(rng, n_filler)
    d = float(rng.uniform(0.8, 0.97)) if depth is None else depth
    facts = [(int(d * len(sentences)), key, value)]
    for _ in range(int(rng.integers(0, 3))):
        other = _word(rng)
        if other != key:
            facts.append((int(rng.uniform(0.0, 0.7) * len(sentences)), other, _value(rng)))
    for pos, k, v in sorted(facts, reverse=True):
        sentences.insert(pos, fact.format(k=k, K=k.capitalize(), v=v))
    q = sep.join(sentences) + "\n\n" + ask.format(k=key)
    thinking = rng.random() < 0.2
    return _render("", [{"role": "user", "content": q}], None, thinking), \
        _completion(value, thinking), value


TASKS = ["greet", "echo", "add", "lang", "read", "bash", "followup"]
