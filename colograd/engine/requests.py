"""What the engine is asked for a rollout: the `vllm.SamplingParams` of the run's settings, the requests of one
rollout (who asks for log-probs, which tokens are never sampled), and the log-probs read back from vLLM's objects.
Preflight builds the same params before start-up, so a setting vLLM refuses is caught there. `Requests` is the engine
as a loop that drives its own requests sees it (`Engine.requests`)."""

import math
from dataclasses import dataclass
from typing import Any

from colograd.config.core import GRPOConfig


@dataclass(frozen=True)
class Sampling:
    """What a rollout samples with, as one value (`Sampling.of(args)`): what `Engine.generate` and its requests read
    of the run's config, and nothing else.

    Attributes:
        num_generations: completions per prompt (G).
        seed: the run's seed (tensor parallelism seeds each engine call from it).
        every_logps: every request asks for its sampled tokens' log-probs (the loss reads them:
            `GRPOConfig.needs_engine_logps`); else only the sampling-gap metric's completion asks.
        replay: the engine records each token's routed experts (`routing_replay: rollout`).
        params: `vllm.SamplingParams`' arguments (`sampling_params`).
    """

    num_generations: int
    seed: int
    every_logps: bool
    replay: bool
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, args: GRPOConfig) -> "Sampling":
        settings = dict(
            n=args.num_generations,
            max_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k if args.top_k > 0 else -1,
            repetition_penalty=args.repetition_penalty,
            min_p=args.min_p or 0.0,
            regex=args.vllm_structured_outputs_regex,
            logprobs=0,  # the sampled token's own log-prob
        )
        return cls(
            num_generations=args.num_generations,
            seed=args.seed,
            every_logps=args.needs_engine_logps,
            replay=args.routing_replay == "rollout",
            params=tuple((settings | (args.generation_kwargs or {})).items()),
        )

    def request(self, seed: int | None = None, **overrides: Any) -> Any:
        """The `vllm.SamplingParams` of one request, seeded `seed` (None: the engine's generator), `overrides`
        replacing the settings (e.g. `n=1` for one turn, `logprobs=None` to leave the log-probs out)."""
        from vllm import SamplingParams

        settings = {"seed": seed} | dict(self.params) | overrides
        regex = settings.pop("regex")
        settings.setdefault("structured_outputs", _structured_outputs(regex))  # generation_kwargs may give its own
        return SamplingParams(**settings)


def rollout_requests(
    sampling: Sampling,
    seeds: list[int | None],
    mine: int,
    counts: list[int],
    gap_sample: bool = True,
    suppressed: list[int] | None = None,
) -> list[tuple[int, Any]]:
    """The engine requests of a rollout of `len(seeds)` prompts (`mine` per rank), as (prompt index, params).

    One request of n = `counts[i]` per prompt (G; fewer for a rank's share of a group that spans ranks), each
    asking for its log-probs where the loss reads them (`sampling.every_logps`); else, with `gap_sample`, only the
    sampling-gap metric's completion asks, the first of each rank's first prompt, in a request of its own (n = 1)
    beside one of n = count - 1, seeded as the one request would have been (vLLM seeds a request's n completions
    seed, seed + 1, ...); without it, none. `suppressed` token ids are never sampled (a bias of -inf: the log-probs
    are those of the distribution without them).
    """
    every = sampling.every_logps
    bias = {"logit_bias": dict.fromkeys(suppressed, -math.inf)} if suppressed else {}
    requests = []
    for i, (seed, g) in enumerate(zip(seeds, counts, strict=True)):
        if every or not gap_sample or i % mine != 0:
            requests.append((i, sampling.request(seed, n=g, **({} if every else {"logprobs": None}), **bias)))
            continue
        requests.append((i, sampling.request(seed, n=1, **bias)))
        if g > 1:
            rest = None if seed is None else seed + 1
            requests.append((i, sampling.request(rest, n=g - 1, logprobs=None, **bias)))
    return requests


def sampled_logps(sample: Any) -> list[float]:
    """The engine's log-prob of each token of a `vllm.CompletionOutput`, NaN for each when it was not asked or
    its objects were not built (the sampler tap reads them instead: `colograd.engine.sampler_tap`)."""
    if not sample.logprobs:
        return [math.nan] * len(sample.token_ids)
    return [pos[tok].logprob for pos, tok in zip(sample.logprobs, sample.token_ids, strict=True)]


def sampling_params(args: GRPOConfig, seed: int | None = None, **overrides: Any) -> Any:
    """The `vllm.SamplingParams` of one rollout request: G completions of a prompt, with the sampled tokens'
    log-probs (`logprobs=None` in `overrides` leaves them out). Building it runs vLLM's own checks of the sampling
    settings (preflight builds one for that).

    Args:
        args: the run's config (num_generations, max_completion_length, temperature, top_p, top_k,
            repetition_penalty, min_p, vllm_structured_outputs_regex, generation_kwargs: `Sampling.of`).
        seed: the request's seed; None draws from the engine's generator.
        overrides: further `SamplingParams` arguments, replacing the ones above (e.g. `n=1` for one turn).
    """
    return Sampling.of(args).request(seed, **overrides)


def _structured_outputs(regex: str | None) -> Any:
    """vLLM's constraint that a completion match `regex`, or None."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(regex=regex) if regex is not None else None


@dataclass(frozen=True)
class Requests:
    """The engine for a loop that drives its own requests (the agents' turns, TRL's `vllm_generation`, the
    benchmarks), from `Engine.requests()`: each request it adds or generates carries what the engine's own rollouts
    carry, the weights' version as its cache salt and the adapter the engine serves.

    Attributes:
        llm: vLLM's `LLM` itself, for a caller that must hand vLLM's own interface on (TRL's `vllm_generation.llm`)
            or time it bare (the benchmarks).
        lora_request: the adapter every request is served with (None: the engine's own weights).
        cache_salt: the salt of requests under the weights the engine holds now.
        tap: the sampler tap that reads sampled log-probs as tensors, or None where the engine has none.
    """

    llm: Any
    lora_request: Any
    cache_salt: str
    tap: Any = None

    def add(self, request_id: str, prompt_ids: list[int], params: Any) -> None:
        """Queue one request (`step` runs it)."""
        prompt = {"prompt_token_ids": prompt_ids, "cache_salt": self.cache_salt}
        self.llm.llm_engine.add_request(request_id, prompt, params, lora_request=self.lora_request)

    def step(self) -> list[Any]:
        """One engine step over the queued requests: the outputs it made (finished ones have `finished`)."""
        return self.llm.llm_engine.step()

    def unfinished(self) -> bool:
        """Whether a queued request is still running."""
        return self.llm.llm_engine.has_unfinished_requests()

    def generate(self, prompts: list[dict[str, Any]], params: Any) -> list[Any]:
        """Run `prompts` (vLLM prompt dicts, `Engine.prompt`'s) to completion with `params` (one, or one each)."""
        prompts = [{"cache_salt": self.cache_salt} | prompt for prompt in prompts]
        return self.llm.generate(prompts, params, lora_request=self.lora_request, use_tqdm=False)
