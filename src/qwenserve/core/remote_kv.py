"""The scheduler's side of prefill/decode disaggregation: requests whose prompt KV is being
pulled (consumer), and finished requests whose blocks wait for a consumer (producer). No torch.

    consumer:  waiting --allocate prompt blocks--> pulling --KV arrived--> waiting (kv_loaded,
               num_computed = prompt - 1) --admitted--> running: recomputes the last prompt
               token for its logits, then decodes. A failed pull fails the request (or, with
               kv_load_failure_policy "recompute", prefills it here).
    producer:  finished with do_remote_decode --> held (blocks kept) --pulled or timed out-->
               blocks freed. The workers learn of a hold in the very step whose sample ends
               the request (its last allowed token: the proxy asks for one), so the blocks are
               served as soon as the answer is out, even if the engine then goes idle; a
               request registered so but finished otherwise (aborted) is released again.

Hybrid models (Gated DeltaNet layers): the consumer resumes before the last prompt token, so
it needs the recurrent state there. The producer's prefill stops once before its last token;
the step that computes it first copies the live state into a slot of its own, held (and pulled)
with the blocks, and the consumer's pull writes it into the request's slot.

An aborted pull keeps its blocks until the workers report the pull ended: they may still be
writing into them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from qwenserve.core.sched_output import KVHold, KVPull, SchedulerOutput
from qwenserve.kv_transfer.config import KVTransferConfig
from qwenserve.kv_transfer.params import producer_answer
from qwenserve.request import Request


@dataclass
class RemoteKV:
    config: KVTransferConfig | None
    block_size: int
    tp_size: int = 1
    hold_timeout_s: float = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT
    pulling: dict[str, Request] = field(default_factory=dict)
    aborted_pulls: set[str] = field(default_factory=set)
    held: dict[str, tuple[Request, float]] = field(default_factory=dict)  # -> deadline
    registered: set[str] = field(default_factory=set)  # holds the workers know of
    state_slots: dict[str, int] = field(default_factory=dict)  # hybrid: held state copies
    _new_pulls: list[KVPull] = field(default_factory=list)
    _new_holds: list[KVHold] = field(default_factory=list)
    _releases: list[str] = field(default_factory=list)

    def start_pull(self, req: Request, block_ids: list[int], state_slot: int | None) -> None:
        remote = req.sampling_params.kv_transfer_params.remote
        req.kv_pull_done = True
        self.pulling[req.request_id] = req
        self._new_pulls.append(KVPull(req.request_id, list(block_ids), remote, state_slot))

    def pull_problem(self, req: Request, has_states: bool) -> str | None:
        """Why the producer's KV cannot serve this request here (None: it can)."""
        remote = req.sampling_params.kv_transfer_params.remote
        bs, n = self.block_size, req.num_prompt_tokens
        if remote.block_size is not None and remote.block_size != bs:
            return (f"the producer's --block-size is {remote.block_size}, this server's is "
                    f"{bs}; start both with the same --block-size")
        if remote.tp_size != self.tp_size and has_states:
            return (f"the producer runs --tensor-parallel-size {remote.tp_size}, this server "
                    f"{self.tp_size}: a hybrid model's recurrent state moves only between "
                    "equal tensor-parallel sizes; give prefill and decode the same tp_size")
        if ((remote.num_tokens is not None and remote.num_tokens < n)
                or len(remote.block_ids) < -(-n // bs)):
            return (f"the producer holds KV for {remote.num_tokens} tokens in "
                    f"{len(remote.block_ids)} blocks, this prompt has {n} tokens: send the "
                    "same prompt to both instances")
        if has_states and not (remote.has_state and remote.num_tokens == n):
            return ("this hybrid model resumes from the producer's recurrent state before the "
                    f"prompt's last token, which the producer did not hold (it computed "
                    f"{remote.num_tokens} tokens of this {n}-token prompt"
                    + ("" if remote.has_state else ", and sent no state")
                    + "): send the prefill request with max_tokens 1 to a qwenserve producer")
        return None

    def wants_hold(self, req: Request) -> bool:
        params = req.sampling_params.kv_transfer_params
        return self.config is not None and params is not None and params.do_remote_decode

    def prefill_limit(self, req: Request, start: int, num_new: int, has_states: bool) -> int:
        """Hybrid producer: the prefill stops once before the last prompt token, whose step
        saves the state the consumer resumes from."""
        last = req.num_prompt_tokens - 1
        if has_states and self.wants_hold(req) and start < last < start + num_new:
            return last - start
        return num_new

    def register(self, req: Request, block_ids: list[int], state_slot: int | None = None
                 ) -> None:
        """Tell the workers to serve ``req``'s blocks (and held state slot), once."""
        if req.request_id not in self.registered:
            self.registered.add(req.request_id)
            if state_slot is not None:
                self.state_slots[req.request_id] = state_slot
            self._new_holds.append(KVHold(req.request_id, list(block_ids), state_slot))

    def unregister(self, request_id: str) -> None:
        """A registered request finished without holding: the workers must not serve it."""
        if request_id in self.registered:
            self.registered.discard(request_id)
            self._releases.append(request_id)

    def hold(self, req: Request, block_ids: list[int]) -> None:
        """Keep ``req``'s blocks for a consumer and note the answer the proxy passes on."""
        cfg = self.config
        self.held[req.request_id] = (req, time.monotonic() + self.hold_timeout_s)
        self.register(req, block_ids)
        req.kv_transfer_out = producer_answer(
            cfg.engine_id, cfg.host, cfg.kv_port, req.request_id, block_ids, self.tp_size,
            self.block_size, req.num_computed_tokens, req.request_id in self.state_slots)

    def take_sent(self, request_ids: list[str]) -> list[Request]:
        """Held requests a consumer has pulled: their blocks can go."""
        self.registered.difference_update(request_ids)
        return [self.held.pop(r)[0] for r in request_ids if r in self.held]

    def take_expired(self) -> list[Request]:
        """Held requests no consumer pulled in time: their blocks go, and are not served."""
        now = time.monotonic()
        gone = [r for r, (_, deadline) in self.held.items() if deadline < now]
        for request_id in gone:
            self.unregister(request_id)
        return [self.held.pop(r)[0] for r in gone]

    def fill(self, out: SchedulerOutput) -> None:
        """This step's news for the workers."""
        out.kv_pulls, self._new_pulls = self._new_pulls, []
        out.kv_holds, self._new_holds = self._new_holds, []
        out.kv_releases, self._releases = self._releases, []
