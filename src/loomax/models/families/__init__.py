"""The model zoo: every family (``model.type``), one file each. GPT-2 (``gpt2``, its body in
``models/blocks/gpt2_model.py``), Llama (``llama``, on ``models/blocks/decoder.py``) and the
families built on it (gemma2, mistral, olmo2, phi3, qwen2, qwen3), the mixtures of experts
(``mixtral``, ``qwen3_moe``, ``olmoe``). Importing this package registers every module in it
(a new family is a new file here, listed nowhere)."""

from loomax.config import import_package_modules

import_package_modules(__name__, __path__)
