"""The first python block of python/README.md runs as written."""

import os
import re
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


class ReadmeExampleTest(unittest.TestCase):
    def test_example_runs(self):
        with open(os.path.join(HERE, "..", "README.md")) as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
        self.assertTrue(blocks, "README.md has no python block")
        exec(compile(blocks[0], "README.md", "exec"), {"__name__": "__readme__"})


if __name__ == "__main__":
    unittest.main(verbosity=2)
