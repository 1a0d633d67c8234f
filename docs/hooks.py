"""mkdocs hook: the site shows the generated diagrams from the top-level `diagrams/` folder.

`epd-ring diagrams` writes them there (the project's layout keeps them beside fsm/, executor/ and
models/, not inside the site). Each file is added to the site as `diagrams/NAME`, so the pages link
to `diagrams/room.svg` as if it lay beside them, with no copy or link in the tree.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File


def on_files(files, config):
    folder = Path(config.config_file_path).parent / "diagrams"
    for path in sorted(folder.glob("*")):
        if path.suffix in (".svg", ".dot"):
            files.append(File.generated(config, f"diagrams/{path.name}", abs_src_path=str(path)))
    return files
