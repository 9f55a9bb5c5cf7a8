"""The engine: a model runner, the prefix cache and the scheduler, advanced one step at a time.

``LLMEngine.step()`` is schedule, ``runner.execute(scheduler output)``, post-process: the
scheduler picks the step's decodes and prompt chunks, the runner computes them on its device
and samples, and the engine indexes newly full blocks in the prefix cache (their KV is written
by then), appends the sampled tokens and finishes requests. It is synchronous and
single-threaded; front ends call it from one thread.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import xxhash

from inference.config import EngineConfig
from inference.device import default_threads
from inference.engine.draft_costs import StepCost
from inference.engine.holds import PinTable
from inference.engine.sampling_params import SamplingParams
from inference.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from inference.engine.sequence import Request
from inference.engine.speculate import DraftPolicy
from inference.engine.tier_io import TierIO
from inference.errors import DocqaError, ModelError, PromptTooLongError
from inference.kv_sizing import KVCacheSpec
from inference.metrics import PrefillCostModel, RequestMetrics
from inference.model.loader import model_fingerprint
from inference.model.tokenizer import TextTokenizer
from inference.runner import ModelRunner, RunnerOutput, make_runner
from prefix_store import KVCacheManager, RedisTier

log = logging.getLogger("docqa.engine")

# end-of-turn markers of the chat templates docqa lays out (prompts/templates.py)
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|endoftext|>")


def _bytes(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else key


class StepFailure(DocqaError):
    """The engine failed a request (the forward pass of its step, or its own sampling or
    bookkeeping, raised); the request's blocks are freed and the engine keeps serving."""

    code = "engine_error"


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        """``runner``: one the caller built for ``config`` (the tests run the CUDA runner on
        CPU tensors under Triton's interpreter); by default the device's (``make_runner``)."""
        self.config = config
        self.model_dir = model_dir = Path(config.model_dir)
        if not (model_dir / "config.json").is_file():
            raise ModelError(f"no model at {model_dir} (expected a directory with config.json)")
        threads = config.num_threads or default_threads()
        if threads != torch.get_num_threads():
            log.info("torch threads: %d (of %d)", threads, torch.get_num_threads())
            torch.set_num_threads(threads)
        self.runner = runner = runner or make_runner(config)
        self.tokenizer = TextTokenizer(model_dir)
        self.model_config = runner.model_config
        self.max_model_len = runner.max_model_len
        self.fingerprint = model_fingerprint(
            model_dir,
            runner.dtype,
            runner.kv_dtype,
            config.block_size,
            config.random_weights_seed,
            runner.compute_signature(),
        )
        self.kv_manager = KVCacheManager(
            self.kv_spec.num_blocks, config.block_size, self.fingerprint, runner.copy_slots
        )
        self.drafts = self._draft_policy()
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_batched_tokens,
                config.max_num_seqs,
                prefill_tokens_with_decodes=config.prefill_tokens_with_decodes,
            ),
            self.kv_manager,
            self.drafts,
        )
        self.pins = PinTable(self.kv_manager, config.pin_budget)
        self.tier_io: TierIO | None = None
        if config.kv_tier is not None:
            tier = RedisTier(
                config.kv_tier,
                self.fingerprint,
                config.block_size,
                self.kv_spec.bytes_per_block,
            )
            self.tier_io = TierIO(tier, self.kv_manager, runner)
            self.scheduler.relook = self.tier_io.relook
        self.cost_model = PrefillCostModel(config.max_num_batched_tokens)
        self.eos_token_ids = self._eos_token_ids()
        self.requests: dict[str, Request] = {}
        # counters (the metrics of docs: prompt tokens computed, output tokens, steps)
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self.num_cancelled = 0
        self.draft_tokens = 0  # drafted tokens verified (speculation)
        self.accepted_draft_tokens = 0  # of those, tokens of the answers
        # the last step, for metrics: (sequences, prefill tokens, decode tokens, seconds in the
        # model); None after a step that ran no batch
        self.last_step: tuple[int, int, int, float] | None = None
        for chunks, seconds in runner.prefill_samples:  # timed at start: fitted already
            self.cost_model.observe(chunks, seconds)

    def _draft_policy(self) -> DraftPolicy | None:
        """Prompt-lookup speculation's policy, where it keeps answers the same: where the
        runner's rows are invariant (``ModelRunner.rows_invariant``: the CPU's compiled
        kernels, a GPU in the batch-invariant mode); None where off."""
        if self.config.speculate == "off":
            return None
        if not self.runner.rows_invariant():
            log.info(
                "speculation off: with these kernels (%s) a verified row's logits may differ "
                "from a decode's, and with them an answer (a GPU keeps them equal in the "
                "batch-invariant mode)",
                self.runner.model.ops.name,
            )
            return None
        return DraftPolicy(self.config.speculation, StepCost(self.runner.row_samples))

    def _eos_token_ids(self) -> frozenset[int]:
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        for t in _END_OF_TURN:
            tid = self.tokenizer.special_id(t)
            if tid is not None and t in self.tokenizer.chat_template:
                eos.add(tid)
        return frozenset(eos)

    @property
    def kv_spec(self) -> KVCacheSpec:
        return self.runner.kv_spec

    @property
    def tier(self) -> RedisTier | None:
        """The second tier, where one is configured."""
        return self.tier_io.tier if self.tier_io is not None else None

    def close(self) -> None:
        """Stop the second tier's threads (queued writes are flushed first)."""
        if self.tier_io is not None:
            self.tier_io.close()
        self.runner.close()

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: bytes = b"",
        use_cache: bool = True,
        keep_logits: bool = False,
        arrival: float | None = None,
        speculate: bool = True,
        draft_group: bytes | str | None = None,
    ) -> Request:
        """Queue a request. ``use_cache=False`` is cache "bypass": nothing is read from the
        prefix cache and nothing of this request is registered in it. ``speculate=False``: no
        drafts for this request (its answer is the same either way). ``draft_group`` (a manual's
        id, say): it also drafts from the earlier answers of its group in its namespace, and
        its answer joins them. ``arrival`` (a
        ``time.perf_counter`` time) is when the request reached the front end, if earlier than
        now: its queue time and TTFT count from there. A ``request_id`` already in the engine
        is refused (ValueError)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise PromptTooLongError("the prompt is empty", self.max_model_len)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt is {n:,} tokens; this model's context is {self.max_model_len:,} tokens "
                "(one position must stay free for the answer)",
                self.max_model_len,
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ModelError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        rid = request_id or f"req_{uuid.uuid4().hex[:16]}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in the engine")
        seed = params.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        seed %= 2**63  # any integer a client sends; torch takes signed 64-bit seeds
        req = Request(
            rid,
            list(prompt_token_ids),
            params,
            namespace=namespace,
            use_cache=use_cache,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            seed=seed,
            keep_logits=keep_logits,
            speculate=speculate,
            draft_group=None if draft_group is None else namespace + b"\0" + _bytes(draft_group),
        )
        if arrival is not None:
            req.times.arrival = min(arrival, req.times.arrival)
        self.scheduler.add(req, reserved_blocks=self.pins.num_pinned_blocks)
        self.requests[rid] = req
        if self.tier_io is not None and use_cache and self.tier_io.up:
            self.tier_io.start_lookup(req)
        return req

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.abort(req)
            req.finish_reason = "abort"
            self.num_cancelled += 1
            self._release_claim(req)

    def _release_claim(self, req: Request) -> None:
        """The request's claim in the second tier (it computed, or no longer computes, the
        prefix other replicas may wait for) is released."""
        if req.tier_claim is not None and self.tier_io is not None:
            self.tier_io.release_claim(req)

    def release(self, req: Request) -> None:
        """Forget a finished request (its blocks are already freed)."""
        self.requests.pop(req.request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def waiting_on_tier(self) -> bool:
        """Requests are held back for second-tier lookups in flight."""
        return self.tier_io is not None and self.tier_io.has_pending

    # -- pins and the second tier -----------------------------------------------------------------
    def pin(self, key: str, token_ids: list[int], namespace: bytes = b"") -> int:
        """``PinTable.pin``: the cached full blocks of ``token_ids`` held under ``key``."""
        return self.pins.pin(key, token_ids, namespace)

    def unpin(self, key: str) -> bool:
        return self.pins.unpin(key)

    def unpin_prefix(self, prefix: str) -> int:
        return self.pins.unpin_prefix(prefix)

    def write_prefix_to_tier(self, token_ids: list[int], namespace: bytes = b"") -> int:
        """``TierIO.write_prefix``; 0 without a second tier."""
        return 0 if self.tier_io is None else self.tier_io.write_prefix(token_ids, namespace)

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Schedule, execute on the runner, post-process; returns the requests that finished
        in this step (those that failed included: finish reason ``error``, ``Request.error``
        says why)."""
        self.last_step = None
        if self.tier_io is not None:
            self.tier_io.install_ready()
        t0, produced = time.perf_counter(), self.generation_tokens
        sched = self.scheduler.schedule(reserved_blocks=self.pins.num_pinned_blocks)
        for req in sched.failed:  # refused at admission: it will not compute what it claimed
            self._release_claim(req)
        if not sched.chunks:
            if self.tier_io is not None:
                self.tier_io.wait(0.05)  # nothing to run: a lookup may finish meanwhile
            return list(sched.failed)
        try:
            out = self.runner.execute(sched)
        except Exception as e:  # the step's requests fail; the engine keeps serving
            log.exception("a step of %d requests failed", len(sched.chunks))
            return [*sched.failed, *(self._fail(c.request, e) for c in sched.chunks)]
        self._record_computed(sched, out.model_s)
        finished = self._append_tokens(sched, out)
        if self.drafts is not None and sched.num_decode_tokens == sched.num_tokens:
            # a step of decodes and verifications: what drafting did at this batch size
            self.drafts.outcomes.observe(
                len(sched.chunks),
                any(c.draft for c in sched.chunks),
                self.generation_tokens - produced,
                time.perf_counter() - t0,
            )
        return [*sched.failed, *finished]

    def _fail(self, req: Request, cause: Exception) -> Request:
        """Finish a request with an error (its blocks freed); returns it."""
        if not req.finished:
            req.error = StepFailure(f"the engine failed this request: {cause}")
            self.scheduler.finish(req, "error")
        self._release_claim(req)
        return req

    def _record_computed(self, sched: SchedulerOutput, model_s: float) -> None:
        """After the forward pass: each chunk's tokens count as computed, blocks that became
        full are indexed (and written through to the second tier), and a step of prompt
        chunks alone teaches the prefill cost model."""
        self.num_steps += 1
        n_decode = sched.num_decode_tokens
        self.last_step = (len(sched.chunks), sched.num_tokens - n_decode, n_decode, model_s)
        bs = self.kv_spec.block_size
        newly: list | None = [] if self.tier_io is not None and self.tier_io.up else None
        prefill_chunks = []
        computed: list[Request] = []  # prompts done whose claims in the second tier go now
        for c in sched.chunks:
            req, n, ctx = c.request, c.num_new_tokens, c.num_context_tokens
            if c.draft:  # the last token's KV holds; the draft's once verified (_verify)
                req.num_computed_tokens = ctx + 1
                continue
            if not c.is_decode:
                self.prompt_tokens_computed += n
                req.times.prefill_s += model_s
                prefill_chunks.append((n, ctx))
            req.num_computed_tokens = ctx + n
            if req.tier_claim is not None and ctx + n >= req.num_prompt_tokens:
                computed.append(req)
            if (ctx + n) // bs > ctx // bs:  # a block became full: hash and index it
                try:
                    self.kv_manager.register_computed(
                        req.request_id, req.all_token_ids, ctx + n, newly
                    )
                except Exception as e:
                    log.exception("indexing the blocks of %s failed", req.request_id)
                    self._fail(req, e)
        if newly:
            self.tier_io.write_through(newly)
        for req in computed:  # after their last blocks are queued for Redis
            self._release_claim(req)
        if prefill_chunks and len(prefill_chunks) == len(sched.chunks):
            self.cost_model.observe(prefill_chunks, model_s)
        elif not prefill_chunks and self.drafts is not None:  # decode and verification rows
            self.drafts.cost.observe(len(sched.chunks), sched.num_tokens, model_s)

    def _append_tokens(self, sched: SchedulerOutput, out: RunnerOutput) -> list[Request]:
        """Each sampled token to its request (a verification's accepted run and the token
        after it); requests that reach an end of turn (unless ``ignore_eos``), ``max_tokens``
        or the context finish, their blocks freed. A request whose sampling or bookkeeping
        raised fails alone."""
        finished = [c.request for c in sched.chunks if c.request.finished]  # failed above
        now = time.perf_counter()
        newly: list | None = [] if self.tier_io is not None and self.tier_io.up else None
        row = 0
        for c in sched.chunks:
            if not c.samples:
                continue
            req, first = c.request, row
            row += c.num_sampled_rows
            if req.finished:
                continue
            try:
                tokens = out.sampled_token_ids[first:row]
                if c.draft:
                    done = self._verify(req, c, tokens, out.logits, first, now, newly)
                else:
                    tok = tokens[0]
                    if isinstance(tok, Exception):
                        raise tok
                    done = self._append_token(req, tok, out.logits, first, now)
                if done:
                    finished.append(req)
            except Exception as e:
                log.exception("the token of %s could not be taken", req.request_id)
                finished.append(self._fail(req, e))
        if newly:
            self.tier_io.write_through(newly)
        return finished

    def _verify(self, req: Request, c, tokens: list, logits, first: int, now, newly) -> bool:
        """A verification's tokens: the one sampled after the request's last token, then each
        sampled after a drafted token that equalled the token sampled before it; the KV of the
        drafted tokens kept becomes the request's (its full blocks indexed). True when that
        finishes the request."""
        ctx, draft, bs = c.num_context_tokens, c.draft, self.kv_spec.block_size
        accepted, done = 0, False
        for j, tok in enumerate(tokens):
            if isinstance(tok, Exception):
                raise tok
            # tokens [0, ctx + 1 + j) are the request's, their KV written: index what filled
            computed = ctx + 1 + j
            if computed % bs == 0:
                self.kv_manager.register_computed(
                    req.request_id, req.all_token_ids, computed, newly
                )
            req.num_computed_tokens = computed
            done = self._append_token(req, tok, logits, first + j, now)
            hit = j < len(draft) and tok == draft[j]
            accepted += hit
            if done or not hit:
                break
        self.draft_tokens += len(draft)
        self.accepted_draft_tokens += accepted
        self.drafts.verified(req, len(draft), accepted)
        return done

    def _append_token(self, req: Request, tok: int, logits, row: int, now: float) -> bool:
        """``tok`` after ``req``'s tokens; True when that finishes the request."""
        if req.keep_logits:
            req.logits.append(logits[row].clone())
        req.output_token_ids.append(tok)
        self.generation_tokens += 1
        if req.times.first_token is None:
            req.times.first_token = now
            if req.num_cached_tokens == 0:  # a cold prefill: its TTFT bounds later estimates
                ttft_ms = (now - req.times.arrival) * 1000
                self.cost_model.record_cold(self.prompt_digest(req), ttft_ms)
        reason = None
        if tok in req.eos_token_ids and not req.params.ignore_eos:
            reason = "stop"
        elif (
            len(req.output_token_ids) >= req.params.max_tokens
            or req.num_tokens >= req.max_model_len
        ):
            reason = "length"
        if reason:
            self.scheduler.finish(req, reason)
            if self.drafts is not None and req.draft_group is not None:
                self.drafts.bank.add(req.draft_group, req.output_token_ids)
        return reason is not None

    # -- reporting ----------------------------------------------------------------------------
    @staticmethod
    def prompt_digest(req: Request) -> bytes:
        """What identifies a request's prompt for the cost model's measured cold runs: its
        namespace and token ids, hashed."""
        h = xxhash.xxh3_128(req.namespace)
        h.update(np.asarray(req.prompt_token_ids, dtype=np.int32).tobytes())
        return h.digest()

    def request_metrics(self, req: Request) -> RequestMetrics:
        t = req.times
        end = t.finished or time.perf_counter()
        first = t.first_token or end
        n_out = len(req.output_token_ids)
        decode_ms = (end - first) * 1000 if t.first_token else 0.0
        cached = max(req.num_cached_tokens, 0)
        digest = self.prompt_digest(req) if cached else None
        saved_ms, basis = self.cost_model.saved(req.num_prompt_tokens, cached, digest)
        return RequestMetrics(
            queue_ms=((t.first_scheduled or end) - t.arrival) * 1000,
            ttft_ms=(first - t.arrival) * 1000,
            prefill_ms=t.prefill_s * 1000,
            decode_ms=decode_ms,
            tpot_ms=decode_ms / (n_out - 1) if n_out > 1 else 0.0,
            e2e_ms=(end - t.arrival) * 1000,
            ttft_saved_ms=saved_ms,
            ttft_saved_basis=basis,
        )
