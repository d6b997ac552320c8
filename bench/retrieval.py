"""Long-context retrieval: can a (compressed) model still find a number hidden deep in a long prompt?

Two tasks, built as token ids so the prompt is exactly the target context long:

- ``passkey`` (after Mohtashami & Jaggi 2023, "Landmark Attention"): one key line, "The pass key is 71432. Remember
  it. 71432 is the pass key.", hidden at a given depth of repetitive filler text; the prompt ends "What is the pass
  key? The pass key is".
- ``multikey``: ``KEYS`` lines "The pass key for <word> is <number>." with distinct words and numbers, the target
  at the requested depth and the others at random sentence boundaries elsewhere; the question names the target word.

Neither intro holds the words its question ends with ("The pass key is"), so a model that copies the intro where
the number belongs scores nothing rather than being scored on the intro (bench/results/accuracy.md "Retrieval: SmolLM2
and Gemma 3 270M, 1K to 8K").

Depth is measured in filler tokens: a key line at depth d follows the filler sentence boundary nearest to
d * (filler tokens), so 0 is right after the instructions and 1 right before the question. Every trial draws its
numbers and words from its own generator, seeded by (seed, task, context, depth, trial), so the prompts do not
depend on the grid they are part of and every model of a comparison sees the same ones. An answer is correct when
the first run of digits in the greedy continuation is the expected number (``score``).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

import kvjax
from bench.files import write_atomic
from kvjax import validate

TASKS = ("passkey", "multikey")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
KEYS = 4  # key lines in a multikey prompt
INTRO = {
    "passkey": (
        "Somewhere in the long text below there is a line with a secret number. Find it and remember it: you will "
        "be asked for it at the end."
    ),
    "multikey": (
        "Several pass keys, each for a different word, are hidden in the long text below. Find them and remember "
        "them: you will be asked for one of them at the end."
    ),
}
FILLER = (  # cycled in this order; the last few sentences (and PAUSES) are chosen to hit the length exactly
    "The morning light falls across the quiet hills.",
    "A small boat drifts slowly along the river.",
    "The baker opens the shop and the street fills with the smell of bread.",
    "Clouds gather over the valley and then move on.",
    "Children walk to school past the old stone bridge.",
    "The clock in the square strikes the hour once more.",
)
PAUSES = ("Birds sing.", "All is calm.", "The air is still.")  # short sentences that make the length exact
WORDS = (  # multikey's key names
    "apple",
    "river",
    "falcon",
    "copper",
    "meadow",
    "lantern",
    "harbor",
    "violet",
    "glacier",
    "thunder",
    "cedar",
    "marble",
    "pepper",
    "saddle",
    "tulip",
    "walrus",
)
_TASK_CODE = {task: n for n, task in enumerate(TASKS)}


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One built trial: its token ids, the number that answers it, and where the target key line sits."""

    ids: list[int]
    expected: str  # the number the answer must start with
    target: str | None  # multikey: the word asked about; passkey: None
    keys: dict[str, str]  # every key line's word ("" for passkey's one key) -> number
    depth: float  # requested depth, a fraction of the filler
    number_position: int  # index in ids of the target number's first token
    filler_before: int  # filler tokens before the target key line
    filler_tokens: int  # filler tokens in the prompt


def _encode(tokenizer, text: str) -> list[int]:
    """``text``'s token ids without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _special_prefix(tokenizer) -> list[int]:
    """The special tokens (a BOS, say) the tokenizer puts before a text; empty where it puts none."""
    plain = _encode(tokenizer, "a")
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    return full[: len(full) - len(plain)] if full[len(full) - len(plain) :] == plain else []


def _first_token_at(tokenizer, ids: list[int], text: str, char: int) -> int:
    """Index of the token of ``ids`` (the encoding of ``text``) that holds character ``char`` of ``text``."""
    for i in range(len(ids)):
        if len(tokenizer.decode(ids[: i + 1])) > char:
            return i
    raise ValueError(f"character {char} lies past the {len(ids)} tokens of {text!r}")


def _exact(total: int, pieces: list[list[int]]) -> list[list[int]] | None:
    """The fewest of ``pieces`` (each usable again) whose lengths sum to ``total``, in order; None if none do."""
    best: dict[int, list[int]] = {0: []}
    for t in range(1, total + 1):
        options = [best[t - len(p)] + [n] for n, p in enumerate(pieces) if t - len(p) in best]
        if options:
            best[t] = min(options, key=len)
    return [pieces[n] for n in best[total]] if total in best else None


def _filler(tokenizer, n: int) -> tuple[list[int], list[int]]:
    """``n`` filler tokens of whole sentences (``FILLER`` cycled, a few ``PAUSES`` to make the length exact) and
    their sentence boundaries in 0..n; a length no whole sentences make (a few tokens) cuts the last one."""
    sentences = [_encode(tokenizer, " " + s) for s in FILLER]
    pauses = [_encode(tokenizer, " " + s) for s in PAUSES]
    longest = max(map(len, sentences + pauses))
    pieces: list[list[int]] = []
    used = 0
    while n - used - len(sentences[len(pieces) % len(sentences)]) >= 2 * longest:
        pieces.append(sentences[len(pieces) % len(sentences)])
        used += len(pieces[-1])
    tail = _exact(n - used, sentences + pauses) if n > used else []
    if tail is None:
        while n > used:
            pieces.append(sentences[len(pieces) % len(sentences)])
            used += len(pieces[-1])
        tail = []
    ids: list[int] = []
    bounds = [0]
    for piece in pieces + tail:
        ids += piece
        bounds.append(min(len(ids), n))
    return ids[:n], sorted(set(bounds))


def _build(tokenizer, task: str, context: int, depth: float, rng: np.random.Generator) -> Prompt:
    """The prompt of ``task`` (checked) with the key line(s) drawn from ``rng``: see ``passkey_prompt``."""
    depth = validate.number("depth", depth, low=0.0, high=1.0)
    context = validate.positive("context", context)
    if tokenizer is None:
        raise ValueError("retrieval prompts need a model with a tokenizer")
    count = 1 if task == "passkey" else KEYS
    numbers = [str(10000 + n) for n in rng.choice(90000, size=count, replace=False)]
    if task == "passkey":
        keys = {"": numbers[0]}
        target = None
        lines = [f" The pass key is {numbers[0]}. Remember it. {numbers[0]} is the pass key."]
        question = " What is the pass key? The pass key is"
    else:
        words = [str(w) for w in rng.choice(WORDS, size=count, replace=False)]
        keys = dict(zip(words, numbers))
        target = words[0]
        lines = [f" The pass key for {w} is {n}." for w, n in keys.items()]
        question = f" What is the pass key for {target}? The pass key for {target} is"
    head = _special_prefix(tokenizer) + _encode(tokenizer, INTRO[task])
    line_ids = [_encode(tokenizer, line) for line in lines]
    tail = _encode(tokenizer, question)
    fixed = len(head) + sum(map(len, line_ids)) + len(tail)
    filler, bounds = _filler(tokenizer, context - fixed)
    if context - fixed < 1 or len(bounds) < count:
        raise ValueError(
            f"a {task} prompt of {context} tokens is too short: its instructions, key line(s) and question take "
            f"{fixed} tokens, leaving {max(context - fixed, 0)} for the filler"
        )
    slots = [min(bounds, key=lambda b: abs(b - depth * len(filler)))]  # the target's boundary (ties: the earlier)
    others = [b for b in bounds if b != slots[0]]
    slots += [int(b) for b in rng.choice(others, size=count - 1, replace=False)]
    ids, start = list(head), 0
    position = 0
    for slot, n in sorted(zip(slots, range(count))):
        ids += filler[start:slot]
        start = slot
        if n == 0:
            number_char = lines[0].index(numbers[0])
            position = len(ids) + _first_token_at(tokenizer, line_ids[0], lines[0], number_char)
        ids += line_ids[n]
    ids += filler[start:] + tail
    return Prompt(ids, numbers[0], target, keys, depth, position, slots[0], len(filler))


def passkey_prompt(tokenizer, context: int, depth: float, rng: np.random.Generator) -> Prompt:
    """A ``context``-token passkey prompt, its random 5-digit key line at ``depth`` (0..1) of the filler."""
    return _build(tokenizer, "passkey", context, depth, rng)


def multikey_prompt(tokenizer, context: int, depth: float, rng: np.random.Generator) -> Prompt:
    """A ``context``-token prompt of ``KEYS`` distinct word/number key lines, the asked one at ``depth`` (0..1)."""
    return _build(tokenizer, "multikey", context, depth, rng)


def build_prompt(task: str, tokenizer, context: int, depth: float, rng: np.random.Generator) -> Prompt:
    """``task``'s prompt ("passkey" or "multikey"), ``context`` tokens long, the target at ``depth``."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    return _build(tokenizer, task, context, depth, rng)


def trial_rng(seed: int, task: str, context: int, depth: float, trial: int) -> np.random.Generator:
    """The generator of one trial: the same (seed, task, context, depth, trial) always draws the same keys."""
    return np.random.default_rng([seed, _TASK_CODE[task], context, round(depth * 10**6), trial])


def score(answer_text: str | None, expected: str | int) -> bool:
    """Whether the first run of digits in ``answer_text`` is exactly ``expected``."""
    found = re.search(r"[0-9]+", answer_text or "")
    return found is not None and found.group() == str(expected)


def _check_grid(tasks, contexts, depths, trials, seed) -> tuple[list[str], list[int], list[float], int, int]:
    """The grid checked (an error names the bad argument): tasks, contexts, depths, trials and seed as plain values."""
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"tasks must be among {', '.join(TASKS)}, got {task!r}")
    if not tasks or not len(contexts) or not len(depths):
        raise ValueError("tasks, contexts and depths must each hold at least one value")
    contexts = [validate.positive("contexts", c) for c in contexts]
    depths = [validate.number("depths", d, low=0.0, high=1.0) for d in depths]
    for name, values in (("tasks", tasks), ("contexts", contexts), ("depths", depths)):
        if len(set(values)) < len(values):
            raise ValueError(f"{name} must be distinct, got {values}")
    return tasks, contexts, depths, validate.positive("trials", trials), validate.seed(seed)


def _record(task: str, context: int, depth: float, trial: int, prompt: Prompt, answer) -> dict:
    """One trial's record: where its key was, what was expected, what came back and whether it is right."""
    return dict(
        task=task,
        context=context,
        depth=depth,
        trial=trial,
        expected=prompt.expected,
        target=prompt.target,
        answer=answer.text,
        correct=score(answer.text, prompt.expected),
        number_position=prompt.number_position,
        prompt_tokens=len(prompt.ids),
    )


def _cells(records: list[dict], context: int, depths: list[float], trials: int) -> list[dict]:
    """Per depth: the trials, how many were correct and the accuracy, from one task's ``records`` at ``context``."""
    cells = []
    for depth in depths:
        correct = sum(r["correct"] for r in records if r["context"] == context and r["depth"] == depth)
        cells.append(dict(context=context, depth=depth, trials=trials, correct=correct, accuracy=correct / trials))
    return cells


def run(
    model,
    tasks: str | Sequence[str],
    contexts: Sequence[int],
    depths: Sequence[float] = DEPTHS,
    trials: int = 50,
    *,
    seed: int = 0,
    max_batch: int = 16,
    max_new_tokens: int = 8,
    chunk_tokens: int = 512,
    backend: str | None = None,
    kv_bits: int | None = None,
    page_size: int | None = None,
    eviction: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, dict]:
    """Per task: accuracy of ``model``'s greedy answers per (context, depth) cell, and every trial's record.

    ``tasks``: a task name or several. All prompts of a context (tasks x depths x trials) go through one
    ``kvjax.generate`` call, so the tasks share its compiled engine; ``kv_bits`` (4 or 2) serves them from a cache
    of quantized pages (``EngineConfig.kv_bits``) of ``page_size`` tokens (None: the engine's default); ``eviction``
    ("kvcompress:8x") evicts each prompt once prefilled (``EngineConfig.eviction``). Contexts
    longer than the model's ``max_position_embeddings`` are skipped, with a message to ``log`` (default: stderr).
    Each task's dict holds "cells" (context, depth, trials, correct, accuracy), "records" (one per trial:
    expected, answer, correct, ...), "contexts" (those run), "skipped", "depths", "seconds" (per context: the wall
    time of the call the tasks shared) and the settings."""
    tasks, contexts, depths, trials, seed = _check_grid(tasks, contexts, depths, trials, seed)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    limit = model.config.max_position_embeddings
    settings = dict(seed=seed, trials=trials, max_new_tokens=max_new_tokens, depths=depths, kv_bits=kv_bits)
    settings |= dict(eviction=eviction)
    out: dict[str, dict] = {
        t: dict(task=t, **settings, contexts=[], skipped=[], seconds={}, cells=[], records=[]) for t in tasks
    }
    for context in contexts:
        if context > limit:
            log(f"{', '.join(tasks)}: skipping context {context}: longer than the model's {limit} positions")
            for results in out.values():
                results["skipped"].append(context)
            continue
        grid = [(task, d, t) for task in tasks for d in depths for t in range(trials)]
        prompts = [
            build_prompt(task, model.tokenizer, context, d, trial_rng(seed, task, context, d, t)) for task, d, t in grid
        ]
        start = time.perf_counter()
        answers = kvjax.generate(
            model,
            [p.ids for p in prompts],
            max_new_tokens=max_new_tokens,
            max_batch=max_batch,
            max_seq_len=context + max_new_tokens,
            chunk_tokens=chunk_tokens,
            backend=backend,
            kv_bits=kv_bits,
            page_size=page_size,
            eviction=eviction,
            progress=progress,
        )
        seconds = time.perf_counter() - start
        for (task, depth, trial), prompt, answer in zip(grid, prompts, answers, strict=True):
            out[task]["records"].append(_record(task, context, depth, trial, prompt, answer))
        for results in out.values():
            results["contexts"].append(context)
            results["seconds"][context] = seconds
            results["cells"] += _cells(results["records"], context, depths, trials)
    return out


def accuracy(results: dict) -> dict[tuple[int, float], float]:
    """``run``'s accuracy per (context, depth) cell."""
    return {(c["context"], c["depth"]): c["accuracy"] for c in results["cells"]}


def heatmap(results: dict, path: str, title: str) -> None:
    """Write a PNG to ``path``: accuracy per context (rows) and depth (columns), each cell's value written in it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    contexts, depths = results["contexts"], results["depths"]
    if not contexts:
        raise ValueError(f"no context of {title!r} was run: nothing to plot")
    cells = accuracy(results)
    grid = np.array([[cells[(c, d)] for d in depths] for c in contexts])
    fig = Figure(figsize=(1.0 * len(depths) + 3.0, 0.55 * len(contexts) + 1.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(contexts)), [str(c) for c in contexts])
    ax.set_xlabel("depth of the key line (fraction of the filler)")
    ax.set_ylabel("context (tokens)")
    ax.set_title(f"{title}\n{results['trials']} trials a cell", fontsize=10)
    for (i, j), value in np.ndenumerate(grid):
        ax.text(
            j,
            i,
            f"{value:.2f}",
            ha="center",
            va="center",
            fontsize=9,
            color="white" if value < 0.2 or value > 0.85 else "black",
        )
    fig.colorbar(image, ax=ax, label="accuracy")
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"), mode="wb")
