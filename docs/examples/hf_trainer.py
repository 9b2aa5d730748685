"""Fine-tune a Hugging Face VLM (Llava / InternVL) on omnibal's balanced packs with OmnibalTrainer.

    omnibal example --out ex            # a small dataset and tiny checkpoints; or your own
    torchrun --nproc-per-node 2 hf_trainer.py ex/internvl ex/annotations.jsonl ex/images out

docs/hf.md quotes this file; tests/test_docs_hf_recipe.py runs it as written.
"""

import sys

import torch
from transformers import AutoModelForImageTextToText, TrainingArguments

from omnibal.data.realdata import RealDataConfig, RealDataset
from omnibal.integrations.hf import OmnibalTrainer

model_dir, annotations, image_root, out = sys.argv[1:5]
model = AutoModelForImageTextToText.from_pretrained(model_dir)
# the checkpoint's tile size, tokens per tile, tile cap, <img> </img> markers, token ids and tokenizer
data = RealDataset(annotations, RealDataConfig.from_hf(model_dir, image_root=image_root))
gpu = torch.cuda.is_available()  # on CPU, use_cpu=True makes the torchrun processes one DDP job (gloo)
args = TrainingArguments(out, per_device_train_batch_size=1, gradient_accumulation_steps=4, num_train_epochs=1,
                         bf16=gpu, use_cpu=not gpu, save_strategy="no", report_to=[])
trainer = OmnibalTrainer(model=model, args=args, train_dataset=data,
                         ledger_path=f"{out}/ledger-rank{{rank}}.jsonl")  # the samples each micro-batch trained
trainer.train()  # resume a run that saved checkpoints: trainer.train(resume_from_checkpoint=True)
trainer.save_model(out)
if torch.distributed.is_initialized():  # leave together: a rank that exits with its process group up can abort
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
