"""python -m megappo.config: print the configuration reference table."""
from megappo.config.docs import config_reference_markdown

print(config_reference_markdown())
