"""Context parallelism for long prefills: prefill.py splits a prompt over ranks and says what moves."""
