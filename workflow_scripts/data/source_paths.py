"""The user's name for a raw file: messages and reports name the file the config points at, never
the workflow's copy of it (``results/data/<dataset>/raw/<file>``) nor download's staging directory
(``results/data/<dataset>/.raw.<host>-<pid>-<random>.partial/<file>``).

``download`` keeps local and url files byte for byte under their own names, so a copied file maps back
one to one: a local source's ``<source.path>/<file>``, a url source's ``<file> in <url>``, a hub
dataset's ``hub dataset <id>@<revision> split <split>``.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings

from workflow_scripts.core.errors import WorkflowError

# Where a path in a message ends: the separators messages put after a file name.
_PATH_TAIL = r"(?:/[^\s:;,'\"()\[\]]*|(?![\w.-]))"  # a path inside the copy, or the copy itself (not raw_other)


class SourceNames:
    """Maps paths under ``copy_dir`` (the raw copy or its staging directory) to the source's names."""

    def __init__(self, copy_dir: str | Path, settings: "DatasetSettings"):
        from workflow_scripts.data.split_layouts import copied_names

        self.copy_dir = Path(copy_dir)
        self.source = settings.source
        self.listed = copied_names(settings)  # a split's several files come from anywhere (source.files)

    def shown(self, path: str | Path) -> str:
        """``path`` as the user knows it (``path`` itself when it is not inside the copy)."""
        relative = next((Path(path).relative_to(base) for base in self._copy_dirs() if Path(path).is_relative_to(base)),
                        None)
        if relative is None:
            return str(path)
        kind = self.source.type
        if relative.as_posix() in self.listed:
            return self.listed[relative.as_posix()]
        if kind == "local":
            return str(Path(self.source.path) / relative) if str(relative) != "." else str(self.source.path)
        if kind == "url":
            return self.source.url if str(relative) == "." else f"{relative} in {self.source.url}"
        where = f"hub dataset {self.source.id}@{self.source.revision}"
        return where if str(relative) == "." else f"{where} split {relative}"

    def translate(self, message: str) -> str:
        """Every path inside the copy that ``message`` names, replaced by the user's name for it."""
        copies = "|".join(re.escape(str(base)) for base in sorted(self._copy_dirs(), key=lambda p: -len(str(p))))
        pattern = r"(?<![\w./-])(?:" + copies + ")" + _PATH_TAIL
        return re.sub(pattern, lambda match: self.shown(match.group(0)), message)

    def _copy_dirs(self) -> list[Path]:
        """The copy as given and as an absolute path (an image's path is made absolute where it is looked up)."""
        absolute = Path(os.path.abspath(self.copy_dir))
        return [self.copy_dir] if absolute == self.copy_dir else [absolute, self.copy_dir]

    def reraise(self, error: WorkflowError) -> WorkflowError:
        """``error`` with its message translated (same type, so a ConfigError stays one)."""
        error.args = (self.translate(str(error)),) + error.args[1:]
        return error
