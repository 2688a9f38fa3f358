"""Chat encodings that are code rather than a Jinja template (DeepSeek-V4), and their output parsers."""
