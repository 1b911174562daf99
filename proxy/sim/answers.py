"""Deterministic, LLM-looking answers for the simulated engine.

The simulator must produce text with the same overlap structure as real multi-tenant traffic
(see docs/background.md, "Shared text that is not a leak"): answers restate their own prompt, carry "generated specifics" that
exist in no prompt (reference numbers, amounts, dates, names), and reuse generic assistant
phrasing that recurs across tenants without being identical every time. Everything is derived
from a SHA-256 of the prompt, so the same prompt always yields the same answer -- like an engine
at temperature 0 -- in every process.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from typing import cast

# Ideographs, kana, CJK punctuation and full-width forms: each character is one unit because
# these scripts have no spaces between words.
CJK_CHARS = "\u3001-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_UNIT_RE = re.compile(rf"\s*(?:[{CJK_CHARS}]|[^\s{CJK_CHARS}]+)|\s+")
# Only letters of the CJK scripts count when deciding "is this text Chinese/Japanese":
# punctuation alone would make "。" look like a language.
_CJK_LETTER_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_KANA_RE = re.compile(r"[\u3040-\u30ff]")
_WORD_RE = re.compile(r"[A-Za-z][A-Za-z0-9'-]*")
_CODE_RE = re.compile(r"\b(?:python|code|function|script|class|def)\b|代码|函数|コード|関数", re.I)
_SLOT_RE = re.compile(r"<(\w+)>")
_CHOICE_RE = re.compile(r"\{([^{}]*)\}")

GENERIC_SENTENCE_TEMPLATES: tuple[str, ...] = (
    "{Certainly|Sure|Of course|Happy to help}! {Here is|Below is|This is} {a summary|an overview|"
    "a step-by-step plan|a short answer|my suggestion} {for you|based on what you shared|"
    "to get you started}.",
    "I would be {happy|glad} to help you with {that request|this|your question}.",
    "{First|To begin|As a first step}, {review|check|confirm} the {current status|details|"
    "latest figures} {with your team|in your records|before you proceed}.",
    "{Next|Then|After that}, {update|adjust|document} the {plan|timeline|settings} {accordingly|"
    "so that everyone is aligned|to reflect the change}.",
    "{Finally|Lastly|To wrap up}, {share|send|circulate} the {summary|results|final version} "
    "{with the stakeholders|with your manager|with the relevant people}.",
    "{Keep in mind|Note|Please note} that {requirements|policies|timelines} {may vary|can change|"
    "differ} {by region|between teams|over time}.",
    "{If you need|Should you need|If you would like} {more detail|further help|a deeper "
    "analysis}, {just let me know|feel free to ask|I can expand on any point}.",
    "{In short|In summary|Overall}, the {best|simplest|safest} {approach|option|path} is to "
    "{start small|move step by step|validate each change} and {iterate|review the outcome|"
    "measure the impact}.",
    "{It is|It's} {a good idea|worth considering|usually helpful} to {write down|track|record} "
    "{each decision|the key assumptions|open questions} {as you go|in one place|early on}.",
    "{This|The following} {approach|process|method} {works well|is common|is reliable} for "
    "{most teams|small projects|day-to-day tasks}.",
    "{Make sure|Be sure|Remember} to {back up|save|double-check} {your data|the original files|"
    "any changes} before {making changes|you continue|you submit anything}.",
    "{Here are|These are|Below are} {a few|some|the main} {points|steps|considerations} to keep "
    "in mind:",
    "{As a rule of thumb|Generally speaking|In most cases}, {clear communication|early "
    "feedback|a written plan} {saves time|avoids confusion|reduces risk} {later on|down the "
    "line|for everyone}.",
    "{I hope|Hopefully} {this helps|that clarifies things|this gives you a clear picture}.",
    "{Let me know|Feel free to tell me|Tell me} if {you need anything else|you have further "
    "questions|you want me to adjust anything}.",
    "{Depending on|Based on} {your goals|the context|your constraints}, you {may|might} "
    "{prefer|choose|want} a {simpler|more detailed|more formal} {version|variant|format}.",
    "{One option|Another option|An alternative} is to {schedule|set up|organise} a "
    "{short call|quick meeting|brief review} {to discuss the details|with the team|this week}.",
    "{Consider|Think about|Try} {breaking the work into|splitting the task into|organising "
    "this as} {smaller steps|clear milestones|short iterations}.",
    "{The key|The main|The most important} {thing|point|factor} is {consistency|clarity|"
    "following up on time}.",
    "{Please|Kindly} {review|verify|check} the {figures|dates|names} {below|above|carefully} "
    "{before sharing them|for accuracy|with the original source}.",
    "{Thank you for|Thanks for} {your question|reaching out|the details}.",
    "{Good question|That is a great question|Great question}{!|.}",
    "{You can|You could|It is possible to} {automate|simplify|streamline} {this step|the "
    "process|most of this} {with a template|with a checklist|using a shared document}.",
    "{Feedback|Input|Review} from {colleagues|your team|an expert} {can|will often} "
    "{catch mistakes early|improve the result|save a lot of time}.",
    "{Be careful|Take care|Watch out} {not to|to avoid} {overcomplicate the first version|"
    "miss a deadline|skip the testing step}.",
)

# Specifics the model "produces": they exist in no prompt, so a page of another tenant's
# output that carries them is a leak that only output fingerprints can catch.
SPECIFIC_SENTENCE_TEMPLATES: tuple[str, ...] = (
    "{Your|The} reference number is <ref>.",
    "{The total comes to|The estimated cost is|The amount due is} <amount>, {due on|payable by|"
    "scheduled for} <date>.",
    "<name> {from our team|on the finance side|in support} will {follow up|get in touch|"
    "confirm the details} {by|before|on} <date>.",
    "{I have logged this as|This is tracked under|Please quote} case <case> {in any reply|"
    "when you contact us|for future reference}.",
    "{The adjusted figure is|After the change the balance is|The projected total is} <amount> "
    "({reference|ref.} <ref>).",
    "Order <order> {was created|is scheduled|was updated} on <date> by <name>.",
)

# Greeting-like templates that open an answer (indexes into GENERIC_SENTENCE_TEMPLATES).
_OPENER_INDEXES: tuple[int, ...] = (0, 1, 20, 21)

_RESTATE_TEMPLATES: tuple[str, ...] = (
    "You asked about <span>.",
    "Regarding <span>, here is what I found.",
    "To answer your question on <span>, see the points below.",
    "Let me address <span> first.",
    "{On|About} <span>: {here are my thoughts|this is how I would approach it}.",
)

_CODE_INTRO_TEMPLATES: tuple[str, ...] = (
    "{Here is|Below is} {a Python example|a small Python script|an implementation} "
    "{that does this|you can adapt|to get you started}:",
    "{The following|This} {code|snippet|function} {shows one way to do it|handles the main case}:",
)

_CJK_ZH_OPENERS: tuple[str, ...] = (
    "当然，我可以帮助您。",
    "好的，没问题。",
    "感谢您的提问。",
    "这是一个很好的问题。",
)
_CJK_ZH_GENERIC: tuple[str, ...] = (
    "以下是详细的说明。",
    "首先，请确认当前的情况。",
    "其次，请与您的团队沟通。",
    "最后，请保存所有的修改。",
    "建议您逐步进行，并记录每一个决定。",
    "如果您需要更多帮助，请随时告诉我。",
    "请注意，具体要求可能因地区而异。",
    "总的来说，最简单的方法是从小处着手。",
    "希望这对您有所帮助。",
)
_CJK_ZH_SPECIFICS: tuple[str, ...] = (
    "您的参考编号是 <ref>。",
    "金额为 <amount>，日期为 <date>。",
    "<name> 将在 <date> 之前与您联系。",
    "案件编号为 <case>，请在回复中注明。",
)
_CJK_JA_OPENERS: tuple[str, ...] = (
    "ご質問ありがとうございます。",
    "もちろん、お手伝いします。",
    "承知しました。",
)
_CJK_JA_GENERIC: tuple[str, ...] = (
    "以下に詳しく説明します。",
    "まず、現在の状況を確認してください。",
    "次に、チームと共有してください。",
    "最後に、変更内容を保存してください。",
    "一つずつ進めることをお勧めします。",
    "ご不明な点があれば、お気軽にお尋ねください。",
    "地域によって要件が異なる場合がありますのでご注意ください。",
    "お役に立てれば幸いです。",
)
_CJK_JA_SPECIFICS: tuple[str, ...] = (
    "参照番号は <ref> です。",
    "金額は <amount>、期日は <date> です。",
    "<name> が <date> までにご連絡します。",
    "ケース番号は <case> です。",
)

# Name pools for generated people: deliberately different from the workload's tenant pools so
# that a generated name usually exists in no prompt.
_GEN_FIRST = (
    "Amelia", "Rafael", "Ingrid", "Tobias", "Noor", "Elias", "Marisol", "Kenji", "Leonie",
    "Dmitri", "Aisha", "Valentin", "Freya", "Mateo", "Sanne", "Oskar", "Priya", "Jonah",
)  # fmt: skip
_GEN_LAST = (
    "Lindqvist", "Okafor", "Brennan", "Castellano", "Haverkamp", "Nakamura", "Vasquez",
    "Østergaard", "Kowalczyk", "Thibodeau", "Ramaswamy", "Achterberg", "Delacroix", "Moreau",
)  # fmt: skip
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip
# Words too common to name a python identifier after.
_STOPWORD_TEXT = (
    "the a an and or but of to in on for with about from by at is are was were be been can "
    "could would should will shall do does did how what which who whom why when where please "
    "you your i me my we our it its this that these those as into than then there here have has "
    "had not no yes if so some any all each more most write python code function script help "
    "need want make using use give show tell explain"
)
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())


def prompt_seed(prompt: str, variant: int = 0) -> int:
    """Stable 64-bit seed for a prompt; `variant` separates n>1 choices of one request.

    SHA-256 rather than hash(): Python's hash() is salted per process, and answers must be
    identical across processes (tests, benchmarks and the server all rely on it).
    """
    data = prompt.encode("utf-8")
    if variant:
        data += b"\x00choice:" + str(variant).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def split_units(text: str) -> list[str]:
    """Split text into units whose concatenation is exactly `text`.

    A unit is a CJK character or a run of non-space characters, each carrying its leading
    whitespace. Units stand in for tokens: max_tokens caps them, usage counts them, and the
    server streams them.
    """
    return _UNIT_RE.findall(text)


def count_units(text: str) -> int:
    """Number of non-blank units in `text` (words, or CJK characters)."""
    return sum(1 for u in split_units(text) if not u.isspace())


def truncate_units(text: str, max_units: int) -> str:
    """First `max_units` units of text, like an engine stopping at max_tokens."""
    kept: list[str] = []
    n = 0
    for u in split_units(text):
        if not u.isspace():
            if n >= max_units:
                break
            n += 1
        kept.append(u)
    return "".join(kept).rstrip()


def is_mostly_cjk(text: str) -> bool:
    """True when most letters of `text` are Chinese/Japanese characters."""
    cjk = len(_CJK_LETTER_RE.findall(text))
    latin = sum(len(w) for w in _WORD_RE.findall(text))
    # A CJK character carries roughly a word's worth of meaning; weigh Latin by ~5 letters/word
    # so a Chinese question that mentions "Python" or an id is still Chinese.
    return cjk > 0 and cjk >= latin / 5


def question_part(prompt: str) -> str:
    """The question of a prompt: its last non-empty line.

    The prompt is chat messages joined by "\\n"; system prompts and pasted documents come first,
    so the last line block is what the user actually asked.
    """
    lines = [ln.strip() for ln in prompt.split("\n") if ln.strip()]
    return lines[-1] if lines else ""


def expand(template: str, rng: random.Random, slots: dict[str, Callable[[], str]]) -> str:
    """Fill `{a|b|c}` choices and `<slot>` placeholders of a template."""
    text = _CHOICE_RE.sub(lambda m: rng.choice(m.group(1).split("|")), template)
    return _SLOT_RE.sub(lambda m: slots[m.group(1)]() if m.group(1) in slots else m.group(0), text)


def _gen_date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(_MONTHS)} {rng.randint(2024, 2026)}"


def _gen_date_cjk(rng: random.Random) -> str:
    return f"{rng.randint(2024, 2026)}年{rng.randint(1, 12)}月{rng.randint(1, 28)}日"


def _gen_amount(rng: random.Random) -> str:
    return f"{rng.choice(('EUR', 'USD', 'GBP', 'CHF'))} {rng.randint(100, 999_999) / 100:,.2f}"


def _specific_slots(rng: random.Random, *, cjk: bool) -> dict[str, Callable[[], str]]:
    """Generators for the "generated specifics" slots; each call draws a fresh value."""
    return {
        "ref": lambda: f"REF-{rng.randint(10_000_000, 99_999_999)}",
        "case": lambda: f"#{rng.randint(1_000_000, 9_999_999)}",
        "order": lambda: f"ORD-{rng.randint(2024, 2026)}-{rng.randint(100_000, 999_999)}",
        "amount": lambda: _gen_amount(rng),
        "date": (lambda: _gen_date_cjk(rng)) if cjk else (lambda: _gen_date(rng)),
        "name": lambda: f"{rng.choice(_GEN_FIRST)} {rng.choice(_GEN_LAST)}",
    }


def _spans(question: str, rng: random.Random, count: int) -> list[str]:
    """Pick `count` contiguous word spans (3-8 words) of the question to restate."""
    words = question.split()
    if not words:
        return []
    spans: list[str] = []
    for _ in range(count):
        length = min(len(words), rng.randint(3, 8))
        start = rng.randint(0, len(words) - length)
        span = " ".join(words[start : start + length]).strip(" ,.;:?!\"'")
        if span and span not in spans:
            spans.append(span)
    return spans


def _cjk_span(question: str, rng: random.Random) -> str:
    """A contiguous run of 4-12 characters of a CJK question, trimmed of punctuation."""
    text = question.strip()
    if not text:
        return ""
    length = min(len(text), rng.randint(4, 12))
    start = rng.randint(0, len(text) - length)
    return text[start : start + length].strip(" ，。？！、：；,.?!")


def _identifiers(question: str, rng: random.Random) -> tuple[str, str]:
    """Prompt-specific python identifiers (function name, argument name)."""
    words = [w.lower() for w in _WORD_RE.findall(question) if len(w) >= 4]
    words = [w.replace("'", "").replace("-", "_") for w in words if w.lower() not in _STOPWORDS]
    if not words:
        words = ["records", "report", "items"]
    k = min(len(words), rng.randint(2, 3))
    start = rng.randint(0, len(words) - k)
    func = "_".join(words[start : start + k])
    arg = rng.choice(words) if len(words) > 1 else "data"
    if arg == func or not arg.isidentifier():
        arg = "data"
    if not func.isidentifier():
        func = "process_" + re.sub(r"\W", "_", func)
    return func, arg


# Values a model writes into examples for every tenant that asks: documentation example
# keys, placeholder emails, test card numbers, filler tokens. They look like entities
# but are nobody's (docs/background.md, "Shared text that is not a leak").
MODEL_PLACEHOLDERS: tuple[str, ...] = (
    'API_KEY = "AKIAIOSFODNN7EXAMPLE"  # replace with your own key',
    'AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"',
    'CONTACT = "john.doe@example.com"',
    'TEST_CARD = "4111 1111 1111 1111"',
    'TOKEN = "sk-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"',
    'ACCOUNT_ID = "12345678"',
    'SUPPORT_PHONE = "(212) 555-0147"',
    'IBAN = "DE89370400440532013000"  # documentation example',
)
PLACEHOLDER_SHARE = 0.4  # of code blocks that carry one


def _code_block(question: str, rng: random.Random) -> str:
    """A python code block: shared boilerplate around prompt-specific identifiers, and
    sometimes a placeholder value (``MODEL_PLACEHOLDERS``, drawn from its own seed so that
    the rest of the answer is as it was)."""
    func, arg = _identifiers(question, rng)
    habit = random.Random(prompt_seed(question, 7919))
    placeholder = ""
    if habit.random() < PLACEHOLDER_SHARE:
        placeholder = habit.choice(MODEL_PLACEHOLDERS) + "\n"
    imports = ["import json", "import logging", "import sys"]
    if rng.random() < 0.5:
        imports.append("from pathlib import Path")
    if rng.random() < 0.3:
        imports.insert(0, "import argparse")
    body_variants = (
        f"    results = {{}}\n    for item in {arg}:\n        key = str(item).strip().lower()\n"
        f"        results[key] = results.get(key, 0) + 1\n    return results",
        f'    if not {arg}:\n        logger.warning("empty input")\n        return {{}}\n'
        f'    return {{"count": len({arg}), "items": sorted({arg})}}',
        f'    cleaned = [x for x in {arg} if x]\n    logger.info("processed %d items", '
        f'len(cleaned))\n    return {{"{func}": cleaned}}',
    )
    return (
        "```python\n"
        + "\n".join(sorted(imports))
        + "\n\nlogger = logging.getLogger(__name__)\n"
        + placeholder
        + "\n\n"
        + f"def {func}({arg}: list) -> dict:\n"
        + f'    """{question[:60].strip()}"""\n'
        + rng.choice(body_variants)
        + "\n\n\ndef main() -> int:\n"
        + "    logging.basicConfig(level=logging.INFO)\n"
        + f"    {arg} = json.load(sys.stdin)\n"
        + f"    print(json.dumps({func}({arg}), indent=2))\n"
        + "    return 0\n\n\n"
        + 'if __name__ == "__main__":\n'
        + "    sys.exit(main())\n"
        + "```"
    )


def _opener(rng: random.Random, slots: dict[str, Callable[[], str]]) -> str:
    """A greeting-style first sentence: the most repeated boilerplate of real assistants."""
    return expand(GENERIC_SENTENCE_TEMPLATES[rng.choice(_OPENER_INDEXES)], rng, slots)


def _restatement(question: str, rng: random.Random, slots: dict[str, Callable[[], str]]) -> str:
    """1-3 sentences restating spans of the question, each with a different template."""
    spans = _spans(question, rng, rng.randint(1, 3))
    templates = rng.sample(_RESTATE_TEMPLATES, k=len(spans))
    return " ".join(
        expand(t, rng, {**slots, "span": cast("Callable[[], str]", lambda s=span: s)})
        for t, span in zip(templates, spans, strict=True)
    )


def _english_answer(question: str, rng: random.Random, *, code: bool) -> str:
    slots = _specific_slots(rng, cjk=False)
    target = rng.randint(60, 250) if not code else rng.randint(50, 120)
    paragraphs = [f"{_opener(rng, slots)} {_restatement(question, rng, slots)}".strip()]
    if code:
        paragraphs.append(expand(rng.choice(_CODE_INTRO_TEMPLATES), rng, slots))
        paragraphs.append(_code_block(question, rng))
    # Each generic template at most once per answer: a real model rarely repeats itself.
    generic = [i for i in range(len(GENERIC_SENTENCE_TEMPLATES)) if i not in _OPENER_INDEXES]
    rng.shuffle(generic)
    words = sum(count_units(p) for p in paragraphs)
    current: list[str] = []
    use_list = rng.random() < 0.3
    para_len = rng.randint(3, 5)
    while words < target and (generic or current):
        if generic and rng.random() >= 0.3:
            sentence = expand(GENERIC_SENTENCE_TEMPLATES[generic.pop()], rng, slots)
        else:
            sentence = expand(rng.choice(SPECIFIC_SENTENCE_TEMPLATES), rng, slots)
        words += count_units(sentence)
        current.append(f"{len(current) + 1}. {sentence}" if use_list else sentence)
        if len(current) >= para_len:
            paragraphs.append(("\n" if use_list else " ").join(current))
            current = []
            use_list = rng.random() < 0.3
            para_len = rng.randint(3, 5)
    if current:
        paragraphs.append(" ".join(s.split(". ", 1)[-1] if use_list else s for s in current))
    return "\n\n".join(paragraphs)


def _cjk_answer(question: str, rng: random.Random, *, code: bool) -> str:
    japanese = bool(_KANA_RE.search(question))
    openers, generic, specifics = (
        (_CJK_JA_OPENERS, _CJK_JA_GENERIC, _CJK_JA_SPECIFICS)
        if japanese
        else (_CJK_ZH_OPENERS, _CJK_ZH_GENERIC, _CJK_ZH_SPECIFICS)
    )
    slots = _specific_slots(rng, cjk=True)
    span = _cjk_span(question, rng)
    restate = f"「{span}」についてですね。" if japanese else f"关于「{span}」，我来为您说明。"
    parts: list[str] = [rng.choice(openers) + (restate if span else "")]
    if code:
        parts.append(_code_block(question, rng))
    target = rng.randint(80, 300)
    pool = list(generic)
    rng.shuffle(pool)
    body: list[str] = []
    total = sum(count_units(p) for p in parts)
    while total < target:
        if pool and rng.random() >= 0.35:
            sentence = pool.pop()
        else:
            sentence = expand(rng.choice(specifics), rng, slots)
        body.append(sentence)
        total += count_units(sentence)
    parts.append("".join(body))
    return "\n\n".join(parts)


def answer_for(prompt: str, *, max_words: int | None = None, variant: int = 0) -> str:
    """The simulated engine's answer to `prompt` (chat messages joined by "\\n").

    Same prompt (and variant) => same answer. `variant` gives the n>1 choices of one request
    different answers; variant 0 is the canonical answer. `max_words` truncates like
    max_tokens does (a prefix of the full answer, possibly mid-sentence).
    """
    rng = random.Random(prompt_seed(prompt, variant))
    question = question_part(prompt)
    code = bool(_CODE_RE.search(question)) or "```" in prompt
    if is_mostly_cjk(question):
        text = _cjk_answer(question, rng, code=code)
    else:
        text = _english_answer(question, rng, code=code)
    if max_words is not None:
        text = truncate_units(text, max(0, max_words))
    return text
