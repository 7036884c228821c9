# tune.py candidate micro-16-compile-1-auto-default-threads-0
# reproduce: python train.py config/tuned/micro-16-compile-1-auto-default-threads-0.py
name = 'micro-16-compile-1-auto-default-threads-0'
micro_batch_size = 16
compile = True
