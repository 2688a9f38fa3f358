"""Speculative decoding with DeepSeek-V4's MTP draft block: loading the block, the rejection rule that
keeps the target's distribution, and a plain (unpaged) reference decoder the engine's speculation is
checked against."""
