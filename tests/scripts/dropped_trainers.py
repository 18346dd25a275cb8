"""Train two tiny trainers one after the other in a fresh process, drop each, and print (as JSON) which of their
trainers, optimizers, engines and engine layers (the embedding) are still alive after a garbage collection: a
notebook's or a sweep's process."""

import gc
import json
import sys
import tempfile
import weakref

from colograd import GRPOTrainer
from colograd.models import tiny


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
        embedding = trainer.engine.llm.collective_rpc(lambda w: weakref.ref(w.model_runner.model.model.embed_tokens))
        refs += [weakref.ref(trainer), weakref.ref(trainer.optimizer), weakref.ref(trainer.engine.llm), embedding[0]]


if __name__ == "__main__":
    refs: list = []
    for _ in range(2):  # the first imports vLLM, the second starts a second engine in the same process
        train_and_drop(refs)
    gc.collect()  # frees the trainers and engines; their engines' finalizers release the engines' layers
    gc.collect()  # which the next collection frees (each layer is in a cycle with its parameters' loaders)
    alive = [ref() is not None for ref in refs]
    print(json.dumps({"alive": alive}), file=sys.stdout)
