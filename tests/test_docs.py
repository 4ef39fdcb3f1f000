"""The README cannot drift from the code: every module and every trainer flag is in it."""

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _section(title: str) -> str:
  text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
  match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
  assert match, f"README.md has no '## {title}' section"
  return match.group(1)


def test_every_module_is_in_the_layout_table():
  layout = _section("Layout")
  for pkg in ("kernels", "tunix_core"):
    for path in sorted(glob.glob(os.path.join(REPO, pkg, "*.py"))):
      name = os.path.basename(path)
      if name == "__init__.py":
        continue
      assert f"`{name}`" in layout or f"`{pkg}/{name}`" in layout, (
          f"{pkg}/{name} is missing from the README's layout table")


def test_every_trainer_flag_is_documented():
  source = open(os.path.join(REPO, "trainer.py"), encoding="utf-8").read()
  names = re.findall(r'(?:DEFINE_\w+|_define_choice)\(\s*"(\w+)"', source)
  assert len(names) > 30, "the flag pattern no longer matches trainer.py"
  table = _section("Trainer flags")
  for name in names:
    assert f"`--{name}`" in table, f"--{name} is missing from the README's flag table"
