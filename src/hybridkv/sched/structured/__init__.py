"""Structured output: decoding constrained to a JSON schema, any JSON object, a regular
expression, a choice of strings or a grammar.

    spec.py      StructuredOutput: what the user asks for, checked when the request arrives
    backend.py   the grammar library (llguidance): the token table and the compile
    manager.py   compiled grammars cached per spec and built off the engine thread; one
                 matcher per request; the token bitmask of each step
"""

from hybridkv.sched.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
