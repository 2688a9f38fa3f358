"""What several kernel folders share: the CPU-interpreter setup and the Triton number codecs.

Nothing here knows an op; each op's folder imports from here, never from another op's folder's
private helpers.
"""
