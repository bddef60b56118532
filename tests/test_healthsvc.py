"""cacheserver.healthsvc: status changes reach the watchers outside the servicer's lock."""
import threading

from grpc_health.v1 import health, health_pb2

from cacheserver.healthsvc import HealthServicer


def lock_taken_while_sending(svc) -> list[bool]:
    """For each status sent: whether another thread could take the servicer's lock meanwhile,
    as a Watch's close callback does in gRPC's serving thread while holding the call's state,
    which the send waits for."""
    took = []

    def send(response):
        closing = threading.Thread(target=lambda: (svc._lock.acquire(), svc._lock.release()), daemon=True)
        closing.start()
        closing.join(2)
        took.append(not closing.is_alive())

    svc._send_response_callbacks[""] = {send}
    svc.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return took


def test_a_watcher_closing_while_the_status_changes_does_not_deadlock():
    # grpc_health's own set() sends while holding the lock: with a closing watcher the two
    # wait on each other (a cacheserver that never finished its drain after SIGTERM)
    assert lock_taken_while_sending(HealthServicer()) == [True]
    assert lock_taken_while_sending(health.HealthServicer()) == [False]   # the defect it avoids


def test_the_status_is_kept_and_reported():
    svc = HealthServicer()
    svc.set("x", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert svc._server_status["x"] == health_pb2.HealthCheckResponse.NOT_SERVING
    svc.enter_graceful_shutdown()
    svc.set("x", health_pb2.HealthCheckResponse.SERVING)                  # ignored once shutting down
    assert svc._server_status["x"] == health_pb2.HealthCheckResponse.NOT_SERVING
