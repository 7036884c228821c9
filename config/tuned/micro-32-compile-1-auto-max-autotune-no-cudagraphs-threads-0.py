# tune.py candidate micro-32-compile-1-auto-max-autotune-no-cudagraphs-threads-0
# reproduce: python train.py config/tuned/micro-32-compile-1-auto-max-autotune-no-cudagraphs-threads-0.py
name = 'micro-32-compile-1-auto-max-autotune-no-cudagraphs-threads-0'
micro_batch_size = 32
compile = True
compile_mode = 'max-autotune-no-cudagraphs'
