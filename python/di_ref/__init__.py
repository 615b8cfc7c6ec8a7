"""deepinfer reference tooling: HF transformers DeepseekV4 as the independent reference.

Never imported at serving time. See docs/reference-tooling.md.
"""

# Bumped whenever the fixture-producing code changes in a way that changes fixture contents.
GENERATOR_VERSION = "di_ref 1"
