"""Train two tiny trainers one after the other in a fresh process, drop each, and print (as JSON) which of their
trainers, optimizers and engines are still alive after a garbage collection: a notebook's or a sweep's process."""

import gc
import json
import sys
import tempfile
import weakref

from colograd import GRPOTrainer, tiny


def train_and_drop(refs: list) -> None:
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(
            model=tiny.build_model(),
            reward_funcs=tiny.letters_reward,
            args=tiny.run_config(out, steps=1),
            train_dataset=tiny.letters_dataset(64),
            processing_class=tiny.build_tokenizer(),
        )
        trainer.train()
        refs += [weakref.ref(trainer), weakref.ref(trainer.optimizer), weakref.ref(trainer.engine.llm)]


if __name__ == "__main__":
    refs: list = []
    for _ in range(2):  # the first imports vLLM, the second starts a second engine in the same process
        train_and_drop(refs)
    gc.collect()
    alive = [ref() is not None for ref in refs]
    print(json.dumps({"alive": alive}), file=sys.stdout)
