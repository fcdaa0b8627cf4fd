"""An Axolotl plugin that adds meter.Meter to the Trainer Axolotl builds, so that an Axolotl run
returns the same timings as the other examples (tokens/s, first step, peak GPU memory,
checkpoint saves). Axolotl builds its Trainer inside `axolotl.train.train`; a plugin named in
the config's `plugins` is its way to add a callback: `plugins: [axolotl_meter.MeterPlugin]`.
Imported by Axolotl in the ranks only.
"""

from axolotl.integrations.base import BasePlugin

import meter


class MeterPlugin(BasePlugin):
    def add_callbacks_post_trainer(self, cfg, trainer):
        # Axolotl saves here only when asked to (the example's measure): each save is flushed
        # to disk and timed.
        return [meter.Meter(durable=True)]
