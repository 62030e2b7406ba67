"""One SGLang worker process whose server arguments are published the way SGLang's scheduler
publishes them (``set_global_server_args_for_scheduler``), so the kvtier backend reads the
checkpoint path, KV dtype and weight version from SGLang's runtime context as it does in a
running server. A process of its own: the arguments are global to it.

    python served_worker.py --socket S --model-path DIR --alias NAME [--weight-version V]
        (--write N | --exists N)

Prints JSON: the backend's answer (pages stored, or leading pages found).
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--alias", required=True)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--write", type=int)
    ap.add_argument("--exists", type=int)
    a = ap.parse_args()
    import sglang.srt.server_args as sa

    from kvtier.testing.sglang import keys, worker

    args = sa.ServerArgs(
        model_path=a.model_path,
        served_model_name=a.alias,
        weight_version=a.weight_version,
        device="cpu",
        skip_tokenizer_init=True,
    )
    sa.set_global_server_args_for_scheduler(args)
    # SGLang passes storage backends the served name; kvtier must not key by it.
    w = worker(a.socket, model=a.alias)
    if a.write:
        ks = keys(a.write, salt="served")
        w.fill(0, a.write, seed=7)
        out = sum(w.backend.batch_set_v1(ks, w.indices(0, a.write)))
    else:
        out = w.backend.batch_exists(keys(a.exists, salt="served"))
    w.backend.close()
    print(json.dumps({"result": out}))


if __name__ == "__main__":
    sys.exit(main())
