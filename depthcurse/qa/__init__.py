"""The Post-LN side made here: fine-tune a SQuAD span head on an encoder, and the alias it gives.

The public face: `FinetuneConfig` and `finetune_qa` (a resumable fine-tune into a normal
checkpoint), `make_trained_alias` (`minilm-l6-squad`, made on first use) and `alias_records`
(its row in `depthcurse assets`).
"""

from depthcurse.qa.alias import alias_records, make_trained_alias
from depthcurse.qa.finetune import FinetuneConfig, finetune_qa

__all__ = ["FinetuneConfig", "finetune_qa", "make_trained_alias", "alias_records"]
