"""Operations on a journal and its store: recover, compact, fsck, inspect.

Each is a library function the CLI renders; none imports the CLI.
"""
