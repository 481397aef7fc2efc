"""The project's command-line tools (``python tools/<name>.py``), importable as ``tools.<name>``.

Why a regular package: a script such as ``tools/preprocess_data.py`` imports its own modules as
``tools.*`` after putting the repository root first on ``sys.path``; without this file another
installed top-level ``tools`` package would take the name.
"""
