"""The plain-library baseline for bench/peers.py: transformers behind a minimal OpenAI-compatible
``/v1/chat/completions`` (streamed or not, greedy), one request at a time, no cross-request cache.

    .venv/bin/python bench/peer_transformers.py --gguf FILE --port 8093 [--threads 2]

Loads the same GGUF file with transformers' own loader and runs it in bfloat16; the chat
template is the one in the file.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gguf", required=True)
    p.add_argument("--port", type=int, default=8093)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, args.dtype)
    ).eval()
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    lock = threading.Lock()
    name = gguf.stem

    def generate(messages, max_tokens, ignore_eos):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        if not isinstance(ids, torch.Tensor):
            ids = ids["input_ids"]
        with lock, torch.inference_mode():
            out = model(ids, use_cache=True)
            past = out.past_key_values
            for _ in range(max_tokens):
                nxt = int(out.logits[0, -1].argmax())
                yield ids.shape[1], nxt
                if nxt in eos and not ignore_eos:
                    return
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _json(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path in ("/health", "/v1/models"):
                self._json(200, {"status": "ok", "data": [{"id": name}]})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                return self._json(404, {"error": "not found"})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            max_tokens = int(body.get("max_tokens") or 256)
            gen = generate(body["messages"], max_tokens, bool(body.get("ignore_eos")))
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            created = int(time.time())
            if not body.get("stream"):
                toks = [t for _, t in gen]
                n_prompt = 0
                return self._json(
                    200,
                    {
                        "id": rid,
                        "object": "chat.completion",
                        "created": created,
                        "model": name,
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": tok.decode(toks)},
                                "finish_reason": "length",
                            }
                        ],
                        "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(toks)},
                    },
                )
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()

            def send(obj):
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                self.wfile.flush()

            def chunk(delta, finish=None):
                return {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                }

            toks: list[int] = []
            text = ""
            n_prompt = 0
            for n, t in gen:
                n_prompt = n
                toks.append(t)
                full = tok.decode(toks)
                if full.endswith("\ufffd"):
                    continue
                send(chunk({"content": full[len(text) :]}))
                text = full
            send(chunk({}, "length" if len(toks) >= max_tokens else "stop"))
            send(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "choices": [],
                    "usage": {
                        "prompt_tokens": n_prompt,
                        "completion_tokens": len(toks),
                        "prompt_tokens_details": {"cached_tokens": 0},
                    },
                }
            )
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"transformers peer on :{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
