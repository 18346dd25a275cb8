"""open-r1's reward functions, by open-r1's names and with open-r1's definitions (huggingface/open-r1 @ 1416fa0c,
`src/open_r1/rewards.py`), so that an open-r1 recipe trains on the reward it names.

open-r1's registry maps 13 names; its recipe fields (`cosine_*`, `repetition_*`, `code_language`,
`max_completion_len`, `soft_punish_cache`) set their parameters, with its defaults (`colograd.config.data`). The code
rewards, `code` and `binary_code`, are `colograd.rewards.code`'s, `cf_code` is `colograd.rewards.code_codeforces` and
`ioi_code` `colograd.rewards.code_ioi`, in the local sandbox.

TRL has rewards of similar names and other definitions: `trl.rewards.accuracy_reward` parses with other
normalisation, its `think_format_reward` checks only the think block, its cosine and repetition rewards count tokens
where open-r1's count characters and words. Those are reached by TRL's names (`accuracy_reward`,
`think_format_reward`, ...), never by open-r1's. tests/rewards/test_open_r1.py holds each function here against
open-r1's own code on a table of cases.

A completion is a chat (open-r1 reads its first message's content) or, here also, plain text.
"""

import math
import re
import threading
from collections.abc import Callable
from typing import Any

RewardFunc = Callable[..., list[float | None]]


def _texts(completions: list) -> list[str]:
    """Each completion's text: itself, or its first message's content (open-r1's `completion[0]["content"]`)."""
    return [c if isinstance(c, str) else c[0]["content"] for c in completions]


def _timeouts(name: str = "parsing_timeout") -> dict[str, Any]:
    """math_verify's time limits (its defaults) use SIGALRM, which only the main thread may set: elsewhere, none
    (as TRL does). `name`: parse's argument, or verify's (`timeout_seconds`)."""
    return {} if threading.current_thread() is threading.main_thread() else {name: None}


def _gold(solution: str) -> list:
    """The reference answer, parsed as open-r1's length-aware rewards parse it (LaTeX extraction, first match)."""
    from math_verify import LatexExtractionConfig, parse

    return parse(solution, extraction_mode="first_match", extraction_config=[LatexExtractionConfig()], **_timeouts())


def _answer(content: str, boxed: Any) -> list:
    """The completion's answer as open-r1 extracts it: strict LaTeX (no malformed operators), boxed first."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse

    normalization = NormalizationConfig(
        nits=False, malformed_operators=False, basic_latex=True, equations=True, boxed=boxed, units=True
    )
    config = LatexExtractionConfig(
        normalization_config=normalization, boxed_match_priority=0, try_extract_without_anchor=False
    )
    return parse(content, extraction_config=[config], extraction_mode="first_match", **_timeouts())


def accuracy_reward(completions: list, solution: list[str], **kwargs: Any) -> list[float | None]:
    """open-r1's `accuracy`: 1.0 when the completion's answer (strict LaTeX, boxed first) verifies against the
    solution, else 0.0; None (no opinion) when the solution does not parse or verification fails."""
    from math_verify import parse, verify

    rewards: list[float | None] = []
    for content, sol in zip(_texts(completions), solution, strict=True):
        gold = parse(sol, extraction_mode="first_match", **_timeouts())
        if not gold:
            rewards.append(None)
            continue
        try:
            rewards.append(float(verify(gold, _answer(content, boxed="all"), **_timeouts("timeout_seconds"))))
        except Exception:  # noqa: BLE001 (open-r1's: a verification that fails is no opinion)
            rewards.append(None)
    return rewards


FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)


def format_reward(completions: list, **kwargs: Any) -> list[float]:
    """open-r1's `format`: 1.0 when the completion is a think block then an answer block, each tag on its own line
    (`<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>`), else 0.0."""
    return [1.0 if FORMAT.match(text) else 0.0 for text in _texts(completions)]


def tag_count_reward(completions: list, **kwargs: Any) -> list[float]:
    """open-r1's `tag_count`: 0.25 for each of `<think>\\n`, `\\n</think>\\n`, `\\n<answer>\\n`, `\\n</answer>` that
    occurs exactly once in a completion."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [sum(0.25 for tag in tags if text.count(tag) == 1) for text in _texts(completions)]


STEPS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def reasoning_steps_reward(completions: list, **kwargs: Any) -> list[float]:
    """open-r1's `reasoning_steps`: a third for each step marker ("Step 1:", a numbered or bulleted line, "First,",
    "Next," ...), up to 1.0 at three."""
    return [min(1.0, len(STEPS.findall(text)) / 3) for text in _texts(completions)]


def _correct(content: str, solution: str) -> bool | None:
    """Whether the completion's answer verifies against the solution (open-r1's length-aware rewards); None when the
    solution does not parse."""
    from math_verify import verify

    gold = _gold(solution)
    if not gold:
        return None
    return bool(verify(_answer(content, boxed=True), gold, **_timeouts("timeout_seconds")))


def len_reward(completions: list, solution: list[str], **kwargs: Any) -> list[float]:
    """open-r1's `length` (Kimi 1.5): within the batch, λ = 0.5 - (len - min) / (max - min) over the completions'
    character lengths; a correct completion gets λ, a wrong one min(0, λ); all 0.0 when the lengths are equal. A
    solution that does not parse counts as correct (open-r1's)."""
    texts = _texts(completions)
    correct = [_correct(text, sol) is not False for text, sol in zip(texts, solution, strict=True)]
    lengths = [len(text) for text in texts]
    shortest, longest = min(lengths), max(lengths)
    if shortest == longest:
        return [0.0] * len(texts)
    rewards = []
    for length, right in zip(lengths, correct, strict=True):
        lam = 0.5 - (length - shortest) / (longest - shortest)
        rewards.append(float(lam if right else min(0, lam)))
    return rewards


def get_cosine_scaled_reward(
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    max_len: int = 1000,
) -> RewardFunc:
    """open-r1's `cosine`: a correct completion's reward falls from `max_value_correct` to `min_value_correct` along
    a cosine over its character length / `max_len`; a wrong one's rises from `min_value_wrong` to `max_value_wrong`
    (a shorter wrong answer is penalised more). A solution that does not parse scores 1.0 (open-r1's)."""

    def cosine_scaled_reward(completions: list, solution: list[str], **kwargs: Any) -> list[float]:
        rewards = []
        for text, sol in zip(_texts(completions), solution, strict=True):
            right = _correct(text, sol)
            if right is None:
                rewards.append(1.0)
                continue
            cosine = math.cos(len(text) / max_len * math.pi)
            low, high = (min_value_correct, max_value_correct) if right else (max_value_wrong, min_value_wrong)
            rewards.append(float(low + 0.5 * (high - low) * (1.0 + cosine)))
        return rewards

    return cosine_scaled_reward


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RewardFunc:
    """open-r1's `repetition_penalty` (Demystifying Long CoT, C.2), on English words: (1 - unique n-grams / n-grams)
    × `max_penalty` over the lower-cased, whitespace-split completion; 0.0 below `ngram_size` words."""
    if max_penalty > 0:
        raise ValueError(f"repetition_max_penalty {max_penalty} should not be positive")

    def repetition_penalty_reward(completions: list, **kwargs: Any) -> list[float]:
        rewards = []
        for text in _texts(completions):
            words = text.lower().split()
            if len(words) < ngram_size:
                rewards.append(0.0)
                continue
            ngrams = list(zip(*[words[i:] for i in range(ngram_size)], strict=False))
            rewards.append((1 - len(set(ngrams)) / len(ngrams)) * max_penalty)
        return rewards

    return repetition_penalty_reward


def get_code_format_reward(language: str = "python") -> RewardFunc:
    """open-r1's `code_format`: 1.0 when the completion is a think block then an answer block holding a
    ```` ```<language> ```` fence; the row's `language` column, where there is one, names the language."""

    def code_format_reward(completions: list, **kwargs: Any) -> list[float]:
        languages = kwargs["language"] if "language" in kwargs else [language] * len(completions)
        rewards = []
        for text, lang in zip(_texts(completions), languages, strict=True):
            pattern = rf"^<think>\n.*?\n</think>\n<answer>\n.*?```{lang}.*?```.*?\n</answer>$"
            rewards.append(1.0 if re.match(pattern, text, re.DOTALL | re.MULTILINE) else 0.0)
        return rewards

    return code_format_reward


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> RewardFunc:
    """open-r1's (and TRL's) `soft_overlong_punishment` (DAPO, eq. 13), over completion tokens: 0 up to
    `max_completion_len - soft_punish_cache`, then falling linearly to -1 at `max_completion_len`, -1 past it."""

    def soft_overlong_punishment_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        start = max_completion_len - soft_punish_cache
        rewards = []
        for ids in completion_ids:
            if len(ids) <= start:
                rewards.append(0.0)
            elif len(ids) <= max_completion_len:
                rewards.append((start - len(ids)) / soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards

    return soft_overlong_punishment_reward
