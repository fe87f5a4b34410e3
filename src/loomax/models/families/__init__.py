"""Model families built on the Llama decoder, one file each; importing this package registers
every module in it (a new family is a new file here, listed nowhere)."""

from loomax.config import import_package_modules

import_package_modules(__name__, __path__)
