"""The engine core process: ``python -m qwenserve.engine.core_proc``, started by the server.

    API process (ProcCoreClient)                  engine process (this module)
    Popen(stdin=PIPE), send_message(args) ---->   read the arguments; watch stdin (EOF = gone)
    PUSH  ipc://.../input   ---- Command ---->    PULL: add / abort / utility call / shutdown
    PULL  ipc://.../output  <--- StepOutputs --   PUSH: one message per step (pickle 5)

The process loads the model (it is the tensor-parallel driver when there are several ranks),
answers ``EngineReady`` or ``EngineFailed``, then runs ``EngineCore`` until told to shut down.
It exits within a second of the API process dying, however that dies (the stdin pipe closes).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from qwenserve.config import DataParallelRank
from qwenserve.engine.arg_utils import EngineArgs
from qwenserve.engine.core_binding import apply_binding, plan_binding, usable_cores
from qwenserve.engine.core_messages import Command, EngineFailed, EngineReady, StepOutputs
from qwenserve.engine.rank_process import DriverLink, read_message
from qwenserve.logger import init_logger

logger = init_logger(__name__)

_Outgoing = EngineReady | EngineFailed | StepOutputs


@dataclass(frozen=True)
class CoreProcArguments:
    engine_args: EngineArgs
    input_address: str  # commands from the API process
    output_address: str  # step outputs to the API process
    omp_threads_bind: str  # QWENSERVE_CPU_OMP_THREADS_BIND, read by the API process
    data_parallel: DataParallelRank | None = None  # DP x EP: the replica's MoE group rank


def run_core(args: CoreProcArguments) -> int:
    tp = int(getattr(args.engine_args, "tensor_parallel_size", 1) or 1)
    binding = plan_binding(args.omp_threads_bind, usable_cores(), tp)
    apply_binding(binding)  # before torch is imported

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(args.input_address)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(args.output_address)

    def send(message: _Outgoing) -> None:
        outbox.send(pickle.dumps(message, protocol=5))

    try:
        code = _serve(args, binding.describe(), inbox, send)
    finally:
        ctx.destroy(linger=5000)  # deliver the last message before the process exits
    return code


def _serve(args: CoreProcArguments, binding: str, inbox: zmq.Socket,
           send: Callable[[_Outgoing], None]) -> int:
    from qwenserve.engine.core import EngineCore  # imports torch: after the binding
    from qwenserve.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_engine_args(args.engine_args, data_parallel=args.data_parallel)
    except Exception as e:  # noqa: BLE001 - one clear message for the user, in the API process
        logger.debug("The engine failed to start", exc_info=True)
        send(EngineFailed(str(e) or type(e).__name__))
        return 1
    logger.info("Engine process %d: %s", os.getpid(), binding)
    core = EngineCore(engine)
    send(core.ready_message())
    try:
        if engine.dp_group is not None:  # DP x EP: step in lock with the other replicas
            from qwenserve.engine.dp_lockstep import serve_in_lockstep

            return serve_in_lockstep(core, engine.dp_group, inbox, send)
        while True:
            timeout_ms = 0 if core.has_work() else 1000
            while inbox.poll(timeout_ms):
                command: Command = pickle.loads(inbox.recv())
                if not core.apply(command):
                    engine.shutdown()
                    return 0
                timeout_ms = 0
            out = core.run_once()
            if out:
                send(out)
    except Exception as e:  # noqa: BLE001 - any failure kills the engine: report it
        logger.exception("The engine loop failed")
        send(EngineFailed(f"the engine failed: {type(e).__name__}: {e}"))
        return 1


def main() -> None:
    stdin = 0
    payload = read_message(stdin)  # at once: the API process writes it right after spawning
    if payload is None:
        raise SystemExit(1)
    DriverLink(stdin, os.getppid(), role="Engine core process").watch()
    # Ctrl+C (SIGINT to the whole process group) and a supervisor's SIGTERM to every process
    # must not kill the engine under a draining server: the API process decides when it stops,
    # and the engine follows it out when it exits.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    code = run_core(pickle.loads(payload))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip tearing down torch's modules: nothing is left to save


if __name__ == "__main__":
    main()
