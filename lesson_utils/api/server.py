"""Start the API server: in a background thread (a notebook cell, Colab: the kernel keeps running) or from the
command line (``python -m lesson_utils.api``). It listens on the loopback address unless told otherwise."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import uvicorn

from lesson_utils.api.app import create_app
from lesson_utils.api.engine_loop import EngineLoop


@dataclass
class RunningServer:
    """A server running in this process: its base ``url`` (``.../v1`` is OpenAI's ``base_url``), its engine loop,
    and :meth:`stop`."""

    url: str
    loop: EngineLoop
    server: uvicorn.Server
    thread: threading.Thread
    model_name: str

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stop(self) -> None:
        """Stop accepting connections, then stop the engine loop (requests still running are left unfinished)."""
        self.server.should_exit = True
        self.thread.join(10)
        self.loop.stop()

    def __enter__(self) -> "RunningServer":
        return self

    def __exit__(self, *_) -> None:
        self.stop()


def start_server(
    engine,
    tokenizer,
    model_name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_waiting: int = 64,
    startup_timeout_s: float = 30.0,
    **loop_options,
) -> RunningServer:
    """Serve ``engine`` (its tokens decoded by ``tokenizer``) as ``model_name`` from a background thread; ``port=0``
    takes a free port; ``loop_options`` go to :class:`EngineLoop` (``cancel=``, ``text_rule=``: lesson 13's
    exercises). Returns once the server accepts connections."""
    loop = EngineLoop(engine, tokenizer, max_waiting=max_waiting, **loop_options).start()
    app = create_app(loop, model_name, engine.w.max_positions)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="api-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            loop.stop()
            raise RuntimeError(f"the API server did not start on {host}:{port} (is the port taken?)")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(f"http://{host}:{bound}", loop, server, thread, model_name)
