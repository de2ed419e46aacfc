"""``python -m lesson_utils.api [--port 8000] [--blocks 512]``: serve the trained SmolLM2-135M-Instruct on the course's
engine (prefix cache on) until interrupted (Ctrl+C, or SIGTERM) - then stop cleanly, exit code 0."""

from __future__ import annotations

import argparse
import signal
import time


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    # explicit: a process started from one that ignores SIGINT (a test runner's worker, a shell's background job)
    # inherits the ignore, and Python then installs no Ctrl+C handler of its own
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--blocks", type=int, default=512, help="KV blocks of 16 tokens")
    args = parser.parse_args(argv)

    from lesson_utils.api.server import start_server
    from lesson_utils.cache.paged import PagedKVCache
    from lesson_utils.memory.sharing import SharingBlockManager
    from lesson_utils.model import weights_from_hf
    from lesson_utils.model.loading import TRAINED_MODEL, load_model
    from lesson_utils.serving.engine import Engine

    lm = load_model(TRAINED_MODEL)
    w = weights_from_hf(lm.model)
    manager = SharingBlockManager(args.blocks, 16, enable_prefix_caching=True, max_seq_len=w.max_positions)
    engine = Engine(w, PagedKVCache.for_model(w, manager=manager))
    server = start_server(engine, lm.tokenizer, "SmolLM2-135M-Instruct", host=args.host, port=args.port)
    print(f"serving SmolLM2-135M-Instruct at {server.url} (OpenAI base_url {server.base_url}; chat page {server.url}/)")
    _stop_on_signals()
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
