"""Fine-tune a Hugging Face model folder on a JSONL file: `pockjax finetune` and
`pockjax.finetune`.

The run is made of the library's parts: the folder's model (a LLaMA-family model in
`pockjax.models.llama`, any other causal LM through `pockjax.torch`), its tokenizer
(`pockjax.tokenizer`), the data (`pockjax.data`), a scheme, and one compiled
`sparse_train` step, run by `pockjax.fit`, which around the step evaluates, logs,
checkpoints and guards:

- the training batches are a function of the step number and the seed alone
  (`pockjax.data.batch_at`), so a checkpoint's step is its whole data position, and a
  resumed run's parameters equal an uninterrupted run's bit for bit;
- checkpoints (`pockjax.save`: parameters, optimizer state, step, checksummed) are
  written atomically every `save_every` steps, on Ctrl-C or SIGTERM and at the end;
  the last `keep` are kept;
- each step's loss is read after the next step is dispatched; a non-finite one stops the run
  (`NonFiniteLoss`) before anything after it is saved, or, with `skip_nonfinite`, the
  step is skipped (`sparse_train(skip_nonfinite=True)`) and counted.

The output folder holds `run.json` (the options), `checkpoints/`, `metrics.jsonl`,
`loss.png` and `final/`, a Hugging Face model folder with the tokenizer files.

The package's modules: `_options` (`FinetuneOptions`: every option's default, check
and help, from which the command line, the keywords and `run.json` are read), `_spec`
(`--scheme` read once into a `SchemeSpec`), `_model` (the folder's model, its loss,
writing it back), `_job` (the run itself, `finetune`), `_run` (the output folder),
`_cli` (`pockjax finetune` / `pockjax generate`), `_base` (the errors), `_formats` (the
frozen weights' formats), `_lr` (`--lr auto`), `_gguf` (GGUF files), and the device
job's `_job_export` (`pockjax export --model`) and `_job_run` (`pockjax run`, no JAX).
Their public names are handed on here.
"""
from pockjax._src.home import claim
from pockjax.finetuning._base import (FRONTENDS, SCHEDULES, FinetuneError,  # noqa: F401
                                      Interrupted, NonFiniteLoss, ProcessLost)
# The command lines' pieces, which `pockjax.cli` builds its subcommands from.
from pockjax.finetuning._cli import (add_arguments, add_generate_arguments,  # noqa: F401
                                     generate_main, generate_text, main)
from pockjax.finetuning._formats import WIDE_PARTS, frozen_formats  # noqa: F401
from pockjax.finetuning._job import FinetuneResult, check_positions, finetune  # noqa: F401
from pockjax.finetuning._model import (LORA_TARGETS, SAVE_DTYPES, LoadedModel,  # noqa: F401
                                       lm_loss, load_model, nll_sum)
from pockjax.finetuning._options import FinetuneOptions
from pockjax.finetuning._run import CHECKPOINTS, FINAL, METRICS, RUN  # noqa: F401
from pockjax.finetuning._spec import (SCHEMES, SchemeSpec, choose_scheme,  # noqa: F401
                                      output_head, scheme_from_spec, spec_number)
from pockjax.finetuning._step import (Placement, choose_devices, make_trainer,  # noqa: F401
                                      trainer_params)

__all__ = ["finetune", "FinetuneOptions", "SchemeSpec", "FinetuneError", "NonFiniteLoss",
           "Interrupted", "ProcessLost", "FinetuneResult", "load_model", "lm_loss", "scheme_from_spec",
           "SCHEMES", "SCHEDULES"]

claim(globals())  # public names defined in the package's modules live here
