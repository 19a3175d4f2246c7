"""--repro-dir DIR: a standalone script for each failing clause (SPEC.md, "Reproducers"), which needs only torch and
the code under test (the zoo for a zoo model or part), exits 1 while the failure is there and 0 once it is fixed.

    write.py          writes each script from the evidence its comparison recorded (properties/core/evidence.py),
                      and rehearses it once: only a script that exits 1 on the code that failed is kept
    script.py         what every script holds: its opening, the plug-in loader, the verdict, and the suite's own
                      functions it calls, written from their source
    kernel.py         the kernel clauses' scripts: the header, the SDPA oracle, the calls and statistical tests;
    kernel_bodies.py  the other kernel comparisons and FlashAttention's APIs
    model.py          the model clauses' scripts: the model built as the run built it;
    model_bodies.py   one body per kind of model comparison
    module.py         the module clauses' scripts: the zoo part built again, redrawn from its seed
"""
