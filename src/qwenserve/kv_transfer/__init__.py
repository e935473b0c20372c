"""Prefill/decode disaggregation (``--kv-transfer-config``, vLLM's P/D protocol over TCP).

    config.py     the flag, parsed and checked (no torch)
    params.py     a request's ``kv_transfer_params``, in and out (no torch)
    transport.py  paged KV blocks as raw bytes over ZeroMQ: the producer's server, the pull
    heads.py      which producer rank serves which KV heads when the two sides' TP differ
    agent.py      the worker's side: serve held blocks, pull remote ones in the background

docs/disaggregation.md tells the whole flow.
"""
