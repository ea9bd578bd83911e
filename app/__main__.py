"""``python -m app``: start the EngineCore, then serve the OpenAI API with hypercorn.

Arguments are checked first (a hub id or a missing --model directory exits
with status 2 and a message), then the listening address is bound, so a taken
port fails at once rather than after the model has loaded. The frontend runs on a uvloop event loop;
the EngineCore process is forked before anything else is imported (an
``EarlyEngine``: it imports torch and the engine while this process reads its
arguments and the model's files, then is told its config, or stopped where the
config needs other thread-pool settings or several engines), and it boots while
this process builds the web stack and the tokenizer (app/frontend.py).
Once the engine is ready, a short banner says what is served and where.
SIGINT/SIGTERM stop accepting connections and drain the requests in flight
for --shutdown-timeout seconds before the engine is shut down; a dead engine
stops the server with status 1 (app/lifecycle.py).
"""

from __future__ import annotations

import logging
import socket
import sys

from core.engine_process import EarlyEngine

logger = logging.getLogger("ringllm")


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for hypercorn to serve on: a port in use fails here, at once. It is
    listened on once the engine is ready (app/frontend.py), so connections are refused until then."""
    family, type_, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    early = None if {"-h", "--help"} & set(args) else _early_engine()
    try:
        _main(args, early)
    finally:
        if early is not None:
            early.shutdown()  # nothing if it became the engine


def _early_engine() -> EarlyEngine | None:
    """The engine process, started before anything else; None if it cannot be (no process or
    pipe to spare): start_engines then spawns one, and reports the failure if it is still there."""
    try:
        return EarlyEngine()
    except OSError:
        return None


def _main(argv: list[str], early: EarlyEngine | None) -> None:
    # Imported once the early engine is on its way: reading the arguments imports the configs.
    from app.cli import build_engine_args, build_frontend_config, make_parser, model_dir_error
    from app.scale_out import run_headless_host, scale_out_error, start_engines

    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.allow_runtime_lora_updating and not args.enable_lora:
        parser.error("--allow-runtime-lora-updating needs --enable-lora")
    if args.allow_runtime_lora_updating and args.api_server_count > 1:
        # Each API server keeps its own table of adapter names: one could not tell the others.
        parser.error("--allow-runtime-lora-updating works with one API server (--api-server-count 1)")
    if args.model is not None and (problem := model_dir_error(args.model)) is not None:
        parser.exit(2, f"{parser.prog}: error: {problem}\n")  # as argparse's errors, less the long usage
    try:
        frontend = build_frontend_config(args)
    except (OSError, ValueError) as exc:  # a --chat-template that is neither a file nor a template
        parser.error(str(exc))
    try:
        engine_args = build_engine_args(args)
    except FileNotFoundError as exc:  # the embedded model's files are missing
        parser.exit(1, f"{exc}\n")
    if (problem := scale_out_error(frontend.scale_out, engine_args)) is not None:
        parser.error(problem)
    if not frontend.scale_out.headless:  # headless hosts run engines only: no HTTP, no socket
        try:
            sock = bind_socket(frontend.host, frontend.port)
        except OSError as exc:
            parser.exit(1, f"cannot listen on {frontend.host}:{frontend.port}: {exc}\n")
    try:
        config = engine_args.resolve()  # once: everything below takes the resolved config
    except (OSError, ValueError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if frontend.scale_out.headless or frontend.scale_out.api_server_count > 1:
        if early is not None:
            early.shutdown()  # these start their engines themselves
        if frontend.scale_out.headless:
            sys.exit(run_headless_host(frontend.scale_out, config))
        from app.api_servers import run_api_servers

        sys.exit(run_api_servers(frontend, config, sock))

    # Start the engine processes now (or tell the early one its config): they boot (torch, the
    # model) while this one imports and builds everything else.
    try:
        engine_core = start_engines(frontend.scale_out, config, early)
    except (RuntimeError, ValueError, OSError) as exc:  # Ray missing or unreachable, a taken RPC port
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    import uvloop

    from app.frontend import serve
    from core.protocol import EngineStartError

    try:
        code = uvloop.run(serve(config, engine_core, frontend, sock))
    except EngineStartError as exc:  # its reason is in the message; the engine logged any traceback
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    finally:
        engine_core.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    main()
