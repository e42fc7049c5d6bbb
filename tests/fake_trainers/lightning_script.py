"""A small Lightning script with the one-line trainq callback; resumes with --ckpt_path (trainq's resume_args)."""

import argparse
import time

import pytorch_lightning as pl
import torch

from trainq.trainer.integrations import TrainqLightningCallback


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(0.1)  # paced so a test can stop it mid-run
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Resumed(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        print(f"resumed at global_step {trainer.global_step}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt_path", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(64, 8)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(
        max_steps=40,
        logger=False,
        enable_checkpointing=False,
        accelerator="cpu",
        enable_model_summary=False,
        callbacks=[TrainqLightningCallback(), Resumed()],
    )
    trainer.fit(Regression(), data, ckpt_path=args.ckpt_path)
    print(f"final global_step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
