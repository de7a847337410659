"""``python -m minillm.config``: print the table of engine options that do not combine."""

from minillm.config.compatibility import table

print(table())
