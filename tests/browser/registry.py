"""Every widget of the course, for the browser test. Registering a notebook's widget is one line.

Key: the notebook's file name without `.ipynb` (under notebooks/). Value: in the order the
notebook shows them, one zero-argument function per `show_interactive` call that builds the
same widget the notebook builds (same arguments). The test drives the real widget in the
browser and this copy in-process, and requires the browser to show what the copy computes.
Optionally `(make, ["control", ...])` limits which controls are moved (default: all), and
TYPED gives the text to type into a Text control.

A notebook whose outputs contain a widget but which is missing here fails the test.
"""

from course_lib.checkpoint import viz as checkpoint_interval_viz
from course_lib.comm import ringviz
from course_lib.data import VOCAB_SIZE
from course_lib.estimate import calculator, calculator_widget, diloco_figures, planner_figures
from course_lib.model import GPTConfig
from course_lib.parallel.cp import figures as cp_figures
from course_lib.parallel.dp import bucketviz
from course_lib.parallel.ep import figures as ep_figures
from course_lib.parallel.hybrid import figures as hybrid_figures
from course_lib.parallel.pp.viz import schedule_widget
from course_lib.parallel.tp.figures import layer_widget
from course_lib.parallel.zero import viz as zero_viz
from course_lib.techniques import checkpoint_viz

WIDGETS = {
    "01_memory_and_flops": [(lambda: calculator_widget.MemoryCalculator(),
                             ["tokens", "preset", "gpu", "tp", "pp", "n_head", "n_experts", "ep", "zero",
                              "offload"])],
    "02_collectives": [lambda: ringviz.ring_widget(4)],
    "03_data_parallel": [lambda: bucketviz.bucket_widget(GPTConfig.tiny(VOCAB_SIZE, d_model=128, n_layer=4))],
    "04_memory_techniques": [lambda: checkpoint_viz.checkpoint_widget(L=16, a_over_b=1)],
    "05_tensor_parallel": [lambda: layer_widget(calculator.E.GPT3_175B, 8, False)],
    "06_pipeline_parallel": [lambda: schedule_widget("interleaved_1f1b", 4, 8, 2)],
    "07_mixture_of_experts": [lambda: ep_figures.load_widget()],
    "08_zero_fsdp": [lambda: zero_viz.zero_widget()],
    "09_context_parallelism": [lambda: cp_figures.cp_widget(131072, 8, "ring")],
    "10_3d_parallelism": [lambda: hybrid_figures.mesh_widget()],
    "11_performance_model": [lambda: planner_figures.planner_widget()],
    "12_checkpoints_elastic": [lambda: checkpoint_interval_viz.interval_widget(30.0, 16384)],
    "13_failures_and_distance": [lambda: diloco_figures.diloco_widget("Llama-3 8B", 4, 100, 10, 1.0)],
}

# Text controls: what the keyboard types, then what the mouse-and-keyboard pass types
# ("3OOB" is a typo: the chart must grey out rather than keep a stale one).
TYPED = {"tokens": ["15T", "3OOB"]}
