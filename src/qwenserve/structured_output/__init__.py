"""Structured outputs: constrain generation to a JSON schema, regex, choice list or EBNF grammar.

    API / offline (plain data)        engine (LLMEngine)             driver worker (ModelRunner)
    StructuredOutputsParams --------> GrammarSpec compiled off the --> RequestGrammars: a matcher
      (vLLM's fields)                 engine thread, cached by spec    per request, advanced with
                                      (GrammarService); the request    each sampled token; fills
                                      waits until its grammar is ready  the step's token bitmask,
                                                                        which the sampler applies
Only plain data (the spec) crosses processes; compiled grammars and matchers stay where they are
used. The grammar engine is a maintained library behind ``backend.GrammarBackend``: xgrammar
(vLLM's default). Importing this package is light; xgrammar loads on the first constrained request.
"""

from __future__ import annotations

from qwenserve.structured_output.params import GrammarSpec, StructuredOutputsParams

__all__ = ["GrammarSpec", "StructuredOutputsParams"]
