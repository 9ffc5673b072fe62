"""``uv run python -m nemo_like.serve --model PATH``: serve a model with the OpenAI API.

PATH is anything ``policy.model_name`` takes: an HF folder, a checkpoint's exported policy, a
``gguf:`` source. Prints the URL and key, and serves until interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nemo_like.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF folder, an exported checkpoint, or gguf:<package>/<file>")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one); default 8000")
    p.add_argument("--api-key", default=None,
                   help="the key clients must send (default: $NEMO_LIKE_API_KEY, else a random one, printed)")
    p.add_argument("--served-model-name", default=None, help="the model id clients ask for (default: --model)")
    p.add_argument("--chat-template", default="default",
                   help="the model's own template (default), 'chatml', a jinja file, or 'raw'")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens (default: the model's max_position_embeddings, at most 4096)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together (default 32)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--decode-mode", default="dynamic", choices=["dynamic", "static", "compiled", "graphs"],
                   help="the engine's decode step (policy.generation.decode_mode); graphs: CUDA graphs, for GPUs")
    args = p.parse_args(argv)

    from nemo_like.serve.loading import load_engine  # torch and transformers: only once the arguments are right
    from nemo_like.serve.server import ServeError, start_server

    try:
        engine = load_engine(args.model, chat_template=args.chat_template, max_model_len=args.max_model_len,
                             max_num_seqs=args.max_num_seqs, threads=args.threads, decode_mode=args.decode_mode)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: --model {args.model}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    key = args.api_key or os.environ.get("NEMO_LIKE_API_KEY") or "auto"
    try:
        handle = start_server(engine, model_name=args.served_model_name or args.model, host=args.host,
                              port=args.port, api_key=key, key="--port", log_level="warning")
    except ServeError as e:
        print(f"error: {e}", file=sys.stderr)
        engine.close()
        return 2
    print(f"[nemo_like] serving {args.served_model_name or args.model} at {handle.base_url} "
          f"(context {engine.context_length} tokens)", flush=True)
    print(f"[nemo_like] api key: {handle.api_key}", flush=True)
    try:
        while True:
            # Short sleeps: Ctrl-C taken by another thread (the engine's, the server's) reaches Python's
            # handler only when the main thread next runs, which one long sleep put off for an hour.
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("[nemo_like] stopping", flush=True)
    finally:
        handle.stop()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
