"""`python -m colograd.bench.vlm_preflight [--rows 100000] [--size 640x480] [--repeats 3]`: how long preflight's
image checks take on a large image dataset.

The dataset is `--rows` rows of a conversational prompt and a JPEG of `--size` pixels each, stored as
`datasets.Image()` (encoded bytes in Arrow, decoded as a row is read), beside the tiny LLaVA and its processor
(`colograd.models.tiny_vlm`).
Timed: `check_image_data`, what `GRPOTrainer` runs on its train dataset before the engine starts: it decodes and
checks a bounded sample of rows (`SAMPLED_ROWS`) and reads the most images of a row from Arrow without decoding.
Before it checked every row: ~4 ms per 640x480 JPEG, 6-7 minutes at 100k rows. Printed: the median seconds over
`--repeats` runs and each run's.
"""

import argparse
import io
import json
import statistics
import time

from datasets import Dataset, Features, Image, Value


def jpeg_dataset(rows: int, size: tuple[int, int] = (640, 480)) -> Dataset:
    """`rows` rows of the colour question and a JPEG of `size` (width, height) pixels, in four colours."""
    from PIL import Image as PILImage

    from colograd.models.tiny_vlm import COLOURS, QUESTION

    encoded = []
    for colour in COLOURS.values():
        buffer = io.BytesIO()
        PILImage.new("RGB", size, colour).save(buffer, format="JPEG")
        encoded.append(buffer.getvalue())
    features = Features({"prompt": [{"role": Value("string"), "content": Value("string")}], "image": Image()})
    prompt = [{"role": "user", "content": QUESTION}]
    return Dataset.from_dict(
        {"prompt": [prompt] * rows, "image": [{"bytes": encoded[i % 4], "path": None} for i in range(rows)]},
        features=features,
    )


def run(rows: int = 100_000, size: str = "640x480", repeats: int = 3) -> dict[str, float | list[float]]:
    """Time `check_image_data` on `rows` image rows of `size` ("WxH"), `repeats` times; returns the median and each
    time (s)."""
    from colograd.models.tiny_vlm import build_model, build_processor
    from colograd.vision.checks import check_image_data

    width, height = map(int, size.split("x"))
    dataset, model, processor = jpeg_dataset(rows, (width, height)), build_model(), build_processor()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        check_image_data(model, processor, dataset)
        times.append(round(time.perf_counter() - start, 3))
    return {"rows": rows, "size": size, "median_s": statistics.median(times), "runs_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m colograd.bench.vlm_preflight", description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--size", default="640x480", help="each JPEG's width x height")
    parser.add_argument("--repeats", type=int, default=3)
    print(json.dumps(run(**vars(parser.parse_args()))))


if __name__ == "__main__":
    main()
