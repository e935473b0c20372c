"""Data parallelism: which engine replicas (data-parallel ranks) a process runs, and where.

vLLM's flags, resolved once by the server (``entrypoints/openai/cli_data_parallel.py``):

    head     --data-parallel-size N [--data-parallel-size-local L]   ranks 0..L-1 here, the rest
             [--data-parallel-address A --data-parallel-rpc-port P]  join over TCP at A:P
    headless --headless --data-parallel-size N --data-parallel-size-local L
             --data-parallel-start-rank R --data-parallel-address A --data-parallel-rpc-port P
                                                                     ranks R..R+L-1, no API server
    external --data-parallel-size N --data-parallel-rank R           rank R alone behind this API
                                                                     server (vLLM's external load
                                                                     balancing)
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ADDRESS = "127.0.0.1"  # vLLM's default (VLLM_DP_MASTER_IP)
DEFAULT_RPC_PORT = 29550  # vLLM's default --data-parallel-rpc-port


@dataclass(frozen=True)
class DataParallelConfig:
    size: int = 1  # N: data-parallel ranks in the whole deployment
    size_local: int = 1  # L: ranks this process runs
    start_rank: int = 0  # the first of them
    address: str = DEFAULT_ADDRESS  # the head's address (remote ranks connect to it)
    rpc_port: int = DEFAULT_RPC_PORT  # the head's handshake port
    headless: bool = False  # engines only: this node joins a head over TCP
    external: bool = False  # --data-parallel-rank: this server runs rank start_rank alone

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.start_rank, self.start_rank + self.size_local))

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        """Ranks the head waits for over TCP (none on a headless node or in external mode)."""
        if self.headless or self.external:
            return ()
        return tuple(r for r in range(self.size) if r not in self.local_ranks)

    @property
    def moe_group_port(self) -> int:
        """DP x EP over several nodes or servers: the MoE group's rendezvous port, next to the
        handshake's on the head (rank 0's node)."""
        return self.rpc_port + 1

    @property
    def spans_processes(self) -> bool:
        """Replicas outside this process tree: on other nodes, or behind other servers."""
        return self.headless or self.external or bool(self.remote_ranks)

    @property
    def engine_indexes(self) -> tuple[int, ...]:
        """The ``engine`` labels this API server reports: its own ranks and the remote ones."""
        return tuple(sorted((*self.local_ranks, *self.remote_ranks)))
