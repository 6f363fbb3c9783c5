"""Progressive task synthesis, teacher data and op-family diagnosis for kernel-writing models.

The library API the recipe stages build on (each module's docstring says why it works the way it does):

* ``generate.GenConfig`` / ``pipeline.generate_task_set`` / ``taskset.write_task_set``: stage 1-3 tasks in
  KernelBench format, validated and decontaminated; ``taskset.read_task_set`` reads any task folder;
* ``validate.validate_task``: run a reference and report the first failing check;
* ``decontam.Decontaminator`` / ``decontam.Reference``: the three KernelBench layers, plus any task set;
* ``diagnose.diagnose`` -> ``write_weights``; ``generate`` reads them back (``read_weights``);
* ``distill.distill``: teacher answers (endpoint or ``teacher.offline_answer``), verified, as SFT rows.
"""
