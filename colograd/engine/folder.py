"""The folder an engine reads its model's architecture from, named by what it holds so that vLLM's compile cache hits.

vLLM keys its torch.compile cache on a hash of its config, and that hash includes the model's path
(`ModelConfig.compute_hash` hashes the `model` field). A fresh temporary folder per start therefore meant a fresh
compile on every start of every rank: about 23 s a rank on a 2-core CPU, minutes of every launch and relaunch on a
GPU. Named by the sha256 of its files, the folder is the same for the same config, tokenizer and stop ids, run after
run, and another for any change, so one model's graphs never serve another's.

The folder is written once, under vLLM's own cache root, and never changed or removed: an engine may be reading it
(one per rank, and other runs on the machine). Several processes placing the same content at once each write a
private staging folder beside it and rename it into place; the first rename wins, the others find the folder there
and drop their copy. Where the cache root cannot be written, the folder is a temporary one, as before.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable

from colograd.runs.time_limit import removed_when_stuck


def engine_folder(
    write: Callable[[str], None], extra: str = "", root: str | None = None, temporary_prefix: str = "colograd-engine-"
) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """The folder holding what `write` writes: ``<root>/<first 16 hex digits of its content's sha256>``, placed
    there by this call unless an earlier one (of any process) did.

    Args:
        write: writes the model's files (config, tokenizer, ...) into the empty folder it is given.
        extra: what else shapes the engine's compiled graph that vLLM's cache key does not see (a process-wide
            switch of vLLM's CPU backend): hashed with the files, so another value gives another folder.
        root: where the folders go; None: ``$VLLM_CACHE_ROOT/colograd/engines``, next to vLLM's compile cache.
        temporary_prefix: the name's start of the temporary folder used where `root` cannot be written.

    Returns:
        The folder's path, and the temporary folder to keep alive while the engine runs (removed when dropped) or
        None for a cached folder.
    """
    if root is None:
        from vllm import envs

        root = os.path.join(envs.VLLM_CACHE_ROOT, "colograd", "engines")
    try:
        os.makedirs(root, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".staging-", dir=root)
    except OSError:  # a read-only cache, or a file in its way: the engine works the same, it compiles afresh
        temporary = removed_when_stuck(tempfile.TemporaryDirectory(prefix=temporary_prefix))
        write(temporary.name)
        return temporary.name, temporary
    try:
        write(staging)
        folder = os.path.join(root, content_hash(staging, extra)[:16])
        os.chmod(staging, 0o755)  # mkdtemp's folder is private; the cache is shared like any model folder
        try:
            os.rename(staging, folder)
        except OSError:  # a rename cannot replace a folder with files in it: it was placed already
            if not os.path.isdir(folder):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already where the rename placed it
    return folder, None


def content_hash(folder: str, extra: str = "") -> str:
    """The sha256 (hex) of `extra` and of the files under `folder`: their paths relative to it, sorted, and bytes."""
    files = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(parent, name)
            with open(path, "rb") as file:
                files[os.path.relpath(path, folder)] = hashlib.sha256(file.read()).hexdigest()
    return hashlib.sha256(json.dumps({"extra": extra, "files": files}, sort_keys=True).encode()).hexdigest()
