"""Image datasets as TRL's users give them, on the tiny LLaVA: one check of a row (`check_row`) for preflight's bounded
sample and for every row of every rollout, streams with their columns discovered, TRL 1.16's conventions, the
processor checked against the model, and the sampling-gap metric's rotation. The engine runs in
`test_streams_train_with_their_images_and_stop_at_a_bad_row` (slow)."""

import functools
import math
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch
from datasets import Dataset, IterableDataset

from colograd import GRPOTrainer
from colograd.config.logging import LoggingOptions
from colograd.data.streaming import ROW_KEY, NumberedRows, RolloutStream, named_rows, row_names
from colograd.errors import ConfigError
from colograd.models.tiny import run_config
from colograd.models.tiny_vlm import QUESTION, build_model, build_processor, colour_reward, save_tiny_vlm, solid_image
from colograd.vision.checks import SAMPLED_ROWS, check_image_data, check_row, image_columns, sample_rows
from colograd.vision.core import image_field, rotate_prompts, row_images

USER = [{"role": "user", "content": QUESTION}]
WITH_PART = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


@functools.cache
def _model_and_processor() -> tuple:
    return build_model(), build_processor()


def _check(row: dict, image_run: bool = True, most: int | None = None) -> list:
    return check_row(row, "train_dataset row 300", _model_and_processor()[1], image_run, most)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        # An image part whose image is None (the processor's bare ValueError, with no row, before).
        ({"prompt": WITH_PART, "image": None}, "row 300: 0 images \\('image' is None\\) for the prompt's 1 image"),
        ({"prompt": WITH_PART, "images": []}, "row 300: 0 images \\('images' is empty\\) for the prompt's 1 image"),
        # LLaVA-style text (a bare StopIteration before): TRL 1.16 adds a part beside it, two placeholders for one.
        ({"prompt": [{"role": "user", "content": "<image>\ncolour?"}], "image": solid_image("red")},
         "row 300: the prompt's text holds the image placeholder '<image>' \\(LLaVA-style\\); .* remove it"),
        ({"prompt": [{"role": "user", "content": "<image> colour?"}], "image": None}, "placeholder '<image>'"),
        ({"prompt": USER, "image": np.zeros((28, 28, 3), np.uint8)},
         "row 300: 'image' is a numpy ndarray \\(28x28x3\\); images must be PIL images: convert it"),
        ({"prompt": USER, "images": [solid_image("red"), torch.zeros(3, 28, 28)]},
         "row 300: 'images\\[1\\]' is a torch Tensor \\(3x28x28\\)"),
        ({"prompt": USER, "images": [solid_image("red"), None]}, "row 300: 'images\\[1\\]' is None; drop it"),
        ({"prompt": USER, "image": {"bytes": b"..", "path": None}}, "'image' is an undecoded image .*cast_column"),
        ({"prompt": USER, "image": [solid_image("red")]}, "'image' is a list, not a PIL image .*'images' column"),
        ({"prompt": "colour?", "image": solid_image("red")}, "row 300: the prompt is text, but image rows need"),
        ({"prompt": WITH_PART, "images": [solid_image("red")] * 2}, "2 images for the prompt's 1 image part"),
    ],
)  # fmt: skip
def test_a_bad_row_is_refused_in_one_line_naming_it_and_its_field(row, message):
    with pytest.raises(ConfigError, match=message) as err:
        _check(row)
    assert "\n" not in str(err.value) and str(err.value).startswith("train_dataset row 300: ")


def test_rows_trl_accepts_pass():
    red, blue = solid_image("red"), solid_image("blue")
    assert _check({"prompt": USER, "image": red}) == [red]
    assert _check({"prompt": WITH_PART, "images": [red]}) == [red]
    assert _check({"prompt": USER, "image": None}) == []  # a text-only row beside image rows
    # Single images in `images` (a column of Image(), not of lists): one image each.
    assert _check({"prompt": USER, "images": red}) == [red]
    # TRL 1.16 reads `images` first: a row with both columns takes its images from `images`.
    assert _check({"prompt": USER, "images": [blue], "image": red}) == [blue]
    assert image_field({"images": [], "image": red}) == "images" and row_images({"images": None, "image": red}) == []
    # A text row of a vision-language run without images: only the placeholder text is checked.
    assert _check({"prompt": "plain text"}, image_run=False) == []
    with pytest.raises(ConfigError, match="more than the 1 per prompt the engine was started for"):
        _check({"prompt": USER, "images": [red, blue]}, most=1)


def test_trls_column_order_is_images_first():
    """The order is TRL 1.16's own (its `_generate_and_score_completions` tests `"images"` before `"image"`)."""
    import inspect

    from trl.trainer.grpo_trainer import GRPOTrainer as TRLTrainer

    source = inspect.getsource(TRLTrainer)
    assert source.index('if "images" in inputs[0]') < source.index('elif "image" in inputs[0]')
    from colograd.vision.core import IMAGE_COLUMNS

    assert IMAGE_COLUMNS == ("images", "image")


def _generator(rows: int, bad: int | None = None):
    def rows_of():
        for i in range(rows):
            image = None if i == bad else solid_image("red")
            yield {"prompt": WITH_PART, "image": image, "colour": "red"}

    return rows_of


def test_stream_columns_are_discovered_and_checked():
    model, processor = _model_and_processor()
    unknown = IterableDataset.from_generator(_generator(300))
    assert unknown.column_names is None and image_columns(unknown) == ["image"]
    assert check_image_data(model, processor, unknown)[0] == 1
    # Columns known: no length (a TypeError before).
    known = Dataset.from_list([{"prompt": USER, "images": [solid_image("red")] * 2}] * 4).to_iterable_dataset()
    assert known.column_names is not None and check_image_data(model, processor, known)[0] == 2
    # A bad row within the rows preflight reads.
    with pytest.raises(ConfigError, match="^train_dataset row 7: 0 images \\('image' is None\\)"):
        check_image_data(model, processor, IterableDataset.from_generator(_generator(300, bad=7)))
    # A text model is refused an image column it only finds by reading the stream.
    from colograd.models.tiny import build_model as build_text_model

    with pytest.raises(ConfigError, match="has an 'image' column but Qwen2ForCausalLM takes no images"):
        check_image_data(build_text_model(), processor, unknown)


class CountedRows:
    """A map-style dataset that counts the rows read."""

    def __init__(self, size: int, bad: int | None = None) -> None:
        self.size, self.bad, self.read, self.column_names = size, bad, [], ["prompt", "image"]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        self.read.append(i)
        return {"prompt": WITH_PART, "image": None if i == self.bad else solid_image("red")}


def test_preflight_reads_a_bounded_sample():
    model, processor = _model_and_processor()
    rows = CountedRows(100_000)
    assert check_image_data(model, processor, rows)[0] == 1
    assert len(set(rows.read)) == SAMPLED_ROWS and len(rows.read) <= 2 * SAMPLED_ROWS
    assert max(rows.read) > SAMPLED_ROWS  # not only the first rows: a draw over the whole dataset
    # A bad row the sample does not reach passes preflight (the rollout's check stops at it).
    sampled = {i for i, _ in sample_rows(CountedRows(1000))}
    past = min(set(range(1000)) - sampled)
    assert check_image_data(model, processor, CountedRows(1000, bad=past))[0] == 1
    with pytest.raises(ConfigError, match=f"^train_dataset row {min(sampled - set(range(128)))}: 0 images"):
        check_image_data(model, processor, CountedRows(1000, bad=min(sampled - set(range(128)))))


def test_most_images_is_read_from_arrow_without_decoding():
    model, processor = _model_and_processor()
    red = solid_image("red")
    rows = [{"prompt": USER, "images": [red]}] * 300 + [{"prompt": USER, "images": [red] * 3}]
    dataset = Dataset.from_list(rows).cast_column("images", datasets.Sequence(datasets.Image()))
    assert check_image_data(model, processor, dataset)[0] == 3  # row 300 is past the first rows preflight reads


def test_max_prompt_length_shorter_than_an_image_prompt_is_refused_before_start():
    model, processor = _model_and_processor()
    dataset = Dataset.from_list([{"prompt": USER, "image": solid_image("red")}] * 3)
    longest = check_image_data(model, processor, dataset)[1]  # 4 placeholders and the question
    with pytest.raises(ConfigError, match=f"^train_dataset row 0: its prompt is {longest} tokens .*max_prompt_length"):
        check_image_data(model, processor, dataset, max_prompt_length=longest - 1)


def _llava_processor(**changes):
    from transformers import LlavaProcessor

    processor = build_processor()
    if "crop" in changes:
        crop = changes.pop("crop")
        processor.image_processor.size = {"shortest_edge": crop}
        processor.image_processor.crop_size = {"height": crop, "width": crop}
    return LlavaProcessor(
        image_processor=processor.image_processor,
        tokenizer=processor.tokenizer,
        chat_template=processor.chat_template,
        **{"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1, **changes},
    )


@pytest.mark.parametrize(
    ("processor_changes", "model_changes", "message"),
    [
        ({"patch_size": 7}, {}, "its patch size is 7 where the model's is 14"),
        ({}, {"image_token_id": 3}, "its image token id is \\d+ where the model's is 3"),
        ({"crop": 56}, {}, "it expands an image to 16 placeholders where the model reads 4 features"),
    ],
)
def test_a_processor_of_another_model_is_refused_naming_both(processor_changes, model_changes, message):
    model = build_model()
    for key, value in model_changes.items():
        setattr(model.config, key, value)
    dataset = Dataset.from_list([{"prompt": USER, "image": solid_image("red")}])
    with pytest.raises(ConfigError, match=message) as err:
        check_image_data(model, _llava_processor(**processor_changes), dataset)
    text = str(err.value)
    assert (
        "\n" not in text
        and "processing_class LlavaProcessor" in text
        and "model LlavaForConditionalGeneration" in text
    )
    assert check_image_data(model if not model_changes else build_model(), _llava_processor(), dataset)[0] == 1


def test_rows_carry_their_index_for_the_rollout_check():
    red = solid_image("red")
    numbered = NumberedRows(Dataset.from_list([{"prompt": USER, "image": red}] * 3))
    assert numbered[2][ROW_KEY] == "train_dataset row 2" and len(numbered) == 3
    rows, names = row_names([numbered[2], numbered[0]])
    assert names == ["train_dataset row 2", "train_dataset row 0"] and all(ROW_KEY not in r for r in rows)
    evaluated = named_rows([{"prompt": USER}], "eval_dataset", [5])
    assert row_names(evaluated) == ([{"prompt": USER}], ["eval_dataset row 5"])
    assert row_names([{"prompt": USER}]) == ([{"prompt": USER}], None)
    # A stream: each row its position as read; the rollout batches are whole.
    stream = RolloutStream(IterableDataset.from_generator(_generator(5)), batch_size=2, repeat_count=2, numbered=True)
    assert [int(row[ROW_KEY].rpartition(" ")[2]) for row in stream] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_an_unreadable_row_is_named_where_it_is_read(tmp_path):
    broken = Dataset.from_dict(
        {"prompt": [USER, USER], "image": [{"bytes": b"not an image", "path": None}] * 2},
        features=datasets.Features({"prompt": [{"role": datasets.Value("string"),
                                                "content": datasets.Value("string")}], "image": datasets.Image()}),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="^train_dataset row 1 cannot be read \\(.*\\); fix or remove it.$"):
        NumberedRows(broken)[1]
    stream = RolloutStream(broken.to_iterable_dataset(), batch_size=1, repeat_count=1, numbered=True)
    with pytest.raises(ConfigError, match="^train_dataset row 0 cannot be read"):
        list(stream)


def _rollout_trainer(output_dir: str, most: int = 1) -> SimpleNamespace:
    """What `GRPOTrainer.sample` and `prepare_prompts` read, with an engine that fails if it is asked anything."""
    model, processor = _model_and_processor()
    fake = SimpleNamespace(
        _vision=True,
        inputs=SimpleNamespace(images_per_prompt=most),
        processing_class=processor,
        args=run_config(output_dir, 1, max_prompt_length=None),
        prompt_limit=64,
        accelerator=SimpleNamespace(num_processes=1, process_index=0),
        engine=SimpleNamespace(),  # `awake` / `generate` missing: an AttributeError if the rollout reached it
    )
    fake.prepare_prompts = functools.partial(GRPOTrainer.prepare_prompts, fake)
    return fake


def test_a_bad_row_stops_its_rollout_before_the_engine_with_preflights_message(tmp_path):
    model, processor = _model_and_processor()
    good = {"prompt": WITH_PART, "image": solid_image("red")}
    rows = [
        {**good, ROW_KEY: "train_dataset row 40"},
        {"prompt": WITH_PART, "image": None, ROW_KEY: "train_dataset row 7000"},
    ]
    trainer = _rollout_trainer(str(tmp_path))
    with pytest.raises(ConfigError) as at_rollout:
        GRPOTrainer.sample(trainer, rows)
    with pytest.raises(ConfigError) as at_preflight:
        check_image_data(model, processor, Dataset.from_list([good, {"prompt": WITH_PART, "image": None}]))
    assert str(at_rollout.value) == str(at_preflight.value).replace("row 1:", "row 7000:")
    assert str(at_rollout.value).startswith("train_dataset row 7000: 0 images ('image' is None)")
    # An evaluation's rows are named by their place in the eval dataset (this rank's share).
    with pytest.raises(ConfigError, match="^eval_dataset row 1: 0 images"):
        GRPOTrainer.sample(trainer, [good, {"prompt": WITH_PART, "image": None}], evaluation=True)
    # A prompt longer than the rollout keeps, named, before the engine.
    trainer.prompt_limit = 5
    with pytest.raises(ConfigError, match="^train_dataset row 40: its prompt is \\d+ tokens with its images expanded"):
        GRPOTrainer.sample(trainer, rows[:1])


def test_the_gap_metric_rotates_through_an_image_rollouts_prompts():
    """`rotate_prompts` puts prompt `shift` first (where the engine asks the metric's log-probs) and gives the
    rollout back in the prompts' own order."""
    calls = []

    def generate(ids, images, report):
        calls.append((ids, images))
        for j in range(len(ids)):
            report(j, [[ids[j][0], c] for c in range(2)])
        completions = [[ids[j][0], c] for j in range(len(ids)) for c in range(2)]
        first = [[0.5, 0.5] if j == 0 and c == 0 else [math.nan] * 2 for j in range(len(ids)) for c in range(2)]
        return Rollout(
            completions,
            first,
            [False] * len(completions),
            engine_prompt_ids=[[i] for i, *_ in ids],
            asked=[not math.isnan(lp[0]) for lp in first],
        )

    from colograd.engine.rollout import Rollout

    reported = []
    rollout = rotate_prompts(
        generate, [[10], [11], [12]], [["a"], ["b"], ["c"]],
        lambda i, comps: reported.append((i, comps[0][0])), shift=2, num_generations=2,
    )  # fmt: skip
    assert calls[0] == ([[12], [10], [11]], [["c"], ["a"], ["b"]])
    assert rollout.completion_ids == [[10, 0], [10, 1], [11, 0], [11, 1], [12, 0], [12, 1]]
    assert rollout.engine_prompt_ids == [[10], [11], [12]]
    assert [i for i, lp in enumerate(rollout.logps) if not math.isnan(lp[0])] == [4]  # prompt 2's first completion
    assert [i for i, asked in enumerate(rollout.asked) if asked] == [4]  # what was asked follows its completion
    assert sorted(reported) == [(0, 10), (1, 11), (2, 12)]


def test_an_image_trainer_puts_another_prompt_first_at_each_rollout_that_asks(tmp_path):
    """`GRPOTrainer.generate` on an image run: the engine's first prompt (whose first completion the gap metric
    reads) moves on at each rollout that asks; a text run's order and an `all` run's are left as they are."""
    from colograd.engine.rollout import Rollout, RolloutContext

    first = []

    def engine_generate(ids, args, *, step, num_generations, gap_sample, on_group, images, counts=None):
        first.append(ids[0][0])
        g = num_generations
        return Rollout([[i[0]] for i in ids for _ in range(g)], [[0.0]] * len(ids) * g, [False] * len(ids) * g)

    def trainer(images_per_prompt: int, **settings) -> SimpleNamespace:
        fake = SimpleNamespace(
            reward_funcs=[], agents=None, processing_class=None,
            args=run_config(str(tmp_path), 1, num_generations=2, **settings),
            inputs=SimpleNamespace(images_per_prompt=images_per_prompt),
            engine=SimpleNamespace(generate=engine_generate),
        )  # fmt: skip
        return fake

    images = [[solid_image("red")]] * 3
    image_run = trainer(1)
    contexts = [RolloutContext([{"prompt": USER}] * 3, 0, 2, gap_turn=turn) for turn in range(4)]
    rollouts = [GRPOTrainer.generate(image_run, [[10], [11], [12]], c, images=images) for c in contexts]
    assert first == [10, 11, 12, 10]
    assert all(r.completion_ids == [[10], [10], [11], [11], [12], [12]] for r in rollouts)  # back in order
    first.clear()
    not_asking = RolloutContext([{"prompt": USER}] * 3, 0, 2, gap_sample=False, gap_turn=1)
    GRPOTrainer.generate(image_run, [[10], [11], [12]], not_asking, images=images)  # a rollout that does not ask
    for run, run_images in ((trainer(0), None), (trainer(1, sampling_gap_completions="all"), images)):
        for c in contexts[1:3]:
            GRPOTrainer.generate(run, [[10], [11], [12]], c, images=run_images)
    assert first == [10, 10, 10, 10, 10]


def test_sampling_gap_completions_setting(tmp_path):
    assert LoggingOptions.__dataclass_fields__["sampling_gap_completions"].default == "one"
    assert not run_config(str(tmp_path), 1).needs_engine_logps  # text runs: unchanged
    assert run_config(str(tmp_path), 1, sampling_gap_completions="all").needs_engine_logps
    with pytest.raises(ConfigError, match="sampling_gap_completions='every' is unknown; use 'one' or 'all'"):
        run_config(str(tmp_path), 1, sampling_gap_completions="every")


@pytest.mark.slow
def test_streams_train_with_their_images_and_stop_at_a_bad_row(tmp_path):
    """One engine per trainer, fp32, the tiny LLaVA, G = 2, 6-token answers:

    (1) a stream whose columns are unknown until read (`from_generator`), its `images` column holding single
    images beside an `image` column that TRL 1.16 ignores, trains with its images: `images/per_prompt` is 1 at
    every step (0 before: the images were dropped), and the sampling gap over every completion
    (`sampling_gap_completions: all`) stays at the fp32 bound; its row 300, past the 256 preflight reads, has an
    image part and no image, and training stops at that rollout with preflight's message, before the engine is
    asked for it. (2) The same from a map-style dataset, the bad row past preflight's sample."""
    path = save_tiny_vlm(str(tmp_path / "tiny-llava"))
    bad, prompts = 300, 60  # the bad row is in the stream's 6th rollout batch

    def rows_of():
        for i in range(2000):
            image = None if i == bad else solid_image(("red", "blue")[i % 2])
            yield {
                "prompt": WITH_PART,
                "images": image,
                "image": solid_image("green"),
                "colour": ("red", "blue")[i % 2],
            }

    settings = dict(
        max_prompt_length=None, per_device_train_batch_size=2 * prompts, num_generations=2,
        max_completion_length=6, logging_steps=1, shuffle_dataset=False, sampling_gap_completions="all",
    )  # fmt: skip
    stream = IterableDataset.from_generator(rows_of)
    trainer = GRPOTrainer(path, colour_reward, run_config(str(tmp_path / "stream"), 10, **settings), stream)
    asked = _count_engine_calls(trainer)
    with pytest.raises(ConfigError) as err:
        trainer.train()
    assert str(err.value).startswith(f"train_dataset row {bad}: 0 images ('images' is None) for the prompt's 1 ")
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == bad // prompts == len(asked), (len(steps), asked)  # nothing asked for the bad rollout
    assert all(h["images/per_prompt"] == 1.0 for h in steps), steps
    gaps = [h["sampling/sampling_logp_difference/max"] for h in steps]
    assert all(not math.isnan(g) and g < 1e-3 for g in gaps), gaps
    del trainer

    rows = Dataset.from_list([{"prompt": WITH_PART, "image": solid_image("red"), "colour": "red"}] * 400)
    past = min(set(range(prompts, 400)) - {i for i, _ in sample_rows(rows)})
    rows = rows.map(lambda row, i: {"image": None} if i == past else {}, with_indices=True)
    trainer = GRPOTrainer(path, colour_reward, run_config(str(tmp_path / "map"), 10, **settings), rows)
    asked = _count_engine_calls(trainer)
    with pytest.raises(ConfigError, match=f"^train_dataset row {past}: 0 images \\('image' is None\\)"):
        trainer.train()
    assert len(asked) == past // prompts


def _count_engine_calls(trainer: GRPOTrainer) -> list:
    """The engine's generate calls, recorded as they are made."""
    calls, generate = [], trainer.engine.generate

    def counted(*args, **kwargs):
        calls.append(1)
        return generate(*args, **kwargs)

    trainer.engine.generate = counted
    return calls
