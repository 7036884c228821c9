# tune.py candidate micro-8-compile-1-auto-default-threads-0
# reproduce: python train.py config/tuned/micro-8-compile-1-auto-default-threads-0.py
name = 'micro-8-compile-1-auto-default-threads-0'
compile = True
