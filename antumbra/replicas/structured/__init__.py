"""Structured output: grammars that constrain what a request may generate, and their token masks.

Library: llguidance. Why it over the alternatives (xgrammar, outlines):
* no torch dependency (a Rust core with a small Python API), so it adds nothing to the model's
  stack and its version does not pin ours;
* Lark grammars with embedded JSON-schema rules (`%json{...}`): one grammar constrains V4's
  DSML tool-call markup and each call's JSON arguments together (`tool_grammar.py`);
* the mask for the next token is computed in Rust, lazily over the tokenizer's trie, with the
  GIL released, and a whole batch of matchers in parallel (`LLExecutor`), so it runs on a worker
  thread while the forward runs;
* vLLM and SGLang both ship it as a structured-output backend.

The pieces, one concern per module:
* `grammars.py` - request formats (JSON schema, any JSON object, Lark) to llguidance grammars,
  with the checks that turn a bad schema into a 400;
* `vocabulary.py` - the checkpoint's `tokenizer.json` as an `LLTokenizer` (built once per engine);
* `matcher.py` - one request's grammar state, advanced with every accepted token;
* `masks.py` - a batch's packed int32 bitmask, filled off the critical path and applied on the
  device in the sampling step (`kernels/token_mask`). Imported from its module: the package itself
  stays free of torch, since the ingress checks grammars with it.
"""

from .grammars import GrammarError, check_grammar, json_object_grammar, json_schema_grammar, lark_grammar
from .matcher import GrammarMatcher
from .vocabulary import GrammarVocabulary

__all__ = [
    "GrammarError",
    "GrammarMatcher",
    "GrammarVocabulary",
    "check_grammar",
    "json_object_grammar",
    "json_schema_grammar",
    "lark_grammar",
]
