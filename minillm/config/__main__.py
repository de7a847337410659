"""``python -m minillm.config``: print the table of engine options that do not combine, then the
environment variables minillm reads or sets."""

from minillm.config import environment
from minillm.config.compatibility import table

print("Options that do not combine (config/compatibility.py):\n")
print(table())
print("\nEnvironment variables (config/environment.py):\n")
print(environment.table())
