"""``--kv-transfer-config`` and ``kv_transfer_params`` parsing: the tutorials' spellings are
accepted, everything else is refused naming the key."""

from __future__ import annotations

import pytest

from qwenserve.kv_transfer.config import parse_kv_transfer_config
from qwenserve.kv_transfer.params import parse_kv_transfer_params

TUTORIAL = ('{"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": '
            '"30000", "engine_id": "0", "kv_connector_extra_config": {"use_ascend_direct": '
            'true, "prefill": {"dp_size": 2, "tp_size": 8}, "decode": {"dp_size": 8, '
            '"tp_size": 4}}}')


def test_tutorial_config():
    cfg = parse_kv_transfer_config(TUTORIAL)
    assert (cfg.connector, cfg.role, cfg.kv_port, cfg.engine_id) == (
        "MooncakeConnectorV1", "kv_producer", 30000, "0")
    assert cfg.prefill.tp_size == 8 and cfg.decode.dp_size == 8
    assert cfg.is_producer and not cfg.is_consumer
    notes = " ".join(cfg.startup_notes())
    assert "use_ascend_direct: no effect" in notes and "not used" in notes


@pytest.mark.parametrize("raw, needle", [
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, "kv_connector"),
    ({"kv_connector": "NixlConnector", "kv_role": "producer"}, "kv_role"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": "x"}, "kv_port"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_bogus": 1}, "kv_bogus"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"prefill": {"tp_size": 0}}}, "prefill.tp_size"),
])
def test_bad_config_names_the_key(raw, needle):
    with pytest.raises(ValueError, match=needle):
        parse_kv_transfer_config(raw)


def test_params():
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({"do_remote_decode": False}) is None
    assert parse_kv_transfer_params({"do_remote_decode": True}).do_remote_decode
    with pytest.raises(ValueError, match="remote_block_ids"):
        parse_kv_transfer_params({"do_remote_prefill": True, "remote_engine_id": "e",
                                  "remote_host": "h", "remote_port": 1, "remote_request_id": "r",
                                  "remote_block_ids": ["a"]})


def test_block_server_survives_garbage_and_refuses_unknown_requests(monkeypatch):
    """A stray client gets an error answer and the server keeps serving."""
    import zmq

    from qwenserve.kv_transfer import transport
    from qwenserve.layers.caches import ModelCaches

    monkeypatch.setattr(transport, "PENDING_S", 0.1)
    port = __import__("socket").socket()
    port.bind(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    server = transport.KVBlockServer(ModelCaches(), 16, "e0", address, lambda rid: None)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        sock.send_multipart([b"x", b"y", b"z"])
        assert sock.poll(5000) and b"malformed" in sock.recv_multipart()[-1]
        with pytest.raises(RuntimeError, match="holds no KV for request r1"):
            transport.pull_blocks(ctx, address, {"request_id": "r1", "block_ids": [1]},
                                  ModelCaches(), [1], 16, timeout_s=5)
    finally:
        ctx.destroy(linger=0)
        server.close()


def test_data_parallel_ranks_get_their_own_kv_ports():
    from qwenserve.engine.arg_utils import EngineArgs

    args = EngineArgs(tensor_parallel_size=2, kv_transfer_config={
        "kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": "30000"})
    assert args.for_data_parallel_rank(0) is args
    assert parse_kv_transfer_config(
        args.for_data_parallel_rank(3).kv_transfer_config).kv_port == 30006
    plain = EngineArgs()
    assert plain.for_data_parallel_rank(2) is plain
